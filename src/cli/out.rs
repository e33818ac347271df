//! Writing results to stdout and the report to stderr with errors returned, not panics.
//!
//! `println!` panics when stdout is a closed pipe (`| head`) or a full disk; every
//! subcommand writes through [`out`] / [`err`] instead (usually via the [`outln!`] and
//! [`errln!`] macros), and `main` turns the error into silence (broken pipe) or one line
//! ("error: writing to stdout: No space left on device", exit 1).

use crate::error::{Error, Result};
use std::io::Write;

/// Writes formatted text to stdout.
pub fn out(args: std::fmt::Arguments) -> Result<()> {
    std::io::stdout()
        .lock()
        .write_fmt(args)
        .map_err(|e| Error::write("stdout", e))
}

/// Writes formatted text to stderr.
pub fn err(args: std::fmt::Arguments) -> Result<()> {
    std::io::stderr()
        .lock()
        .write_fmt(args)
        .map_err(|e| Error::write("stderr", e))
}

/// Flushes stdout (stdout is line-buffered: a full disk shows up here, not in `write`).
pub fn flush() -> Result<()> {
    std::io::stdout()
        .lock()
        .flush()
        .map_err(|e| Error::write("stdout", e))
}

/// Writes `s` to stdout and flushes it (streamed text).
pub fn stream(s: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_all(s.as_bytes())
        .and_then(|_| o.flush())
        .map_err(|e| Error::write("stdout", e))
}

/// `println!` to stdout, returning `crate::Result<()>`.
#[macro_export]
macro_rules! outln {
    () => { $crate::cli::out::out(format_args!("\n")) };
    ($($t:tt)*) => { $crate::cli::out::out(format_args!("{}\n", format_args!($($t)*))) };
}

/// `eprintln!` to stderr, returning `crate::Result<()>`.
#[macro_export]
macro_rules! errln {
    ($($t:tt)*) => { $crate::cli::out::err(format_args!("{}\n", format_args!($($t)*))) };
}
