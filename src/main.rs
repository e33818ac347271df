//! The `tinygpt-cpu` binary: parse flags, run, print errors as one line.

use clap::Parser;
use tinygpt_cpu::cli::{out, run, Cli};
use tinygpt_cpu::Error;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // Help and usage errors; a closed stdout/stderr is not worth a panic here either.
            let _ = e.print();
            std::process::exit(e.exit_code());
        }
    };
    let result = run(cli).and_then(|()| out::flush().map_err(Into::into));
    if let Err(e) = result {
        std::process::exit(report(&e));
    }
}

/// Prints `e` as one line on stderr (unless there is nobody to read it) and returns the
/// exit code: 0 for a closed pipe (the reader has gone away, as `| head` does), 130 after
/// ctrl-c, 1 otherwise.
fn report(e: &anyhow::Error) -> i32 {
    let ours = e.downcast_ref::<Error>();
    if ours.is_some_and(Error::is_broken_pipe) {
        return 0;
    }
    // Results already written stay in front of the error line.
    let _ = out::flush();
    if let Some(Error::Interrupted(_)) = ours {
        let _ = out::err(format_args!("{e}\n"));
        return 130;
    }
    // One line, no backtrace: the error names the file/tensor/flag. Sources are appended
    // only when the message does not already quote them.
    let mut line = e.to_string();
    for src in e.chain().skip(1) {
        let s = src.to_string();
        let bare = s.rsplit_once(" (os error ").map_or(s.as_str(), |(b, _)| b);
        if !line.contains(bare) {
            line = format!("{line}: {s}");
        }
    }
    let _ = out::err(format_args!("error: {line}\n"));
    1
}
