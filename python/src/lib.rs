//! `tinygpt_cpu._native`: the engine behind the `tinygpt_cpu` Python package
//! (docs/python.md). The public API (`tinygpt_cpu.Model`, OpenAI-shaped dicts) is the
//! Python layer in `tinygpt_cpu/__init__.py`; this module gives it a loaded model
//! ([`model::Model`]) and a token-at-a-time generation ([`generation::Generation`]).
//!
//! Everything is checked by the CLI's own code: the cache, engine and sampling options are
//! parsed by the CLI's clap definitions (`CacheArgs`, `EngineArgs`, `SampleArgs`,
//! `PerplexityArgs`) from the flags they stand for, then validated by the functions `sample`
//! and `perplexity` call, so a bad value raises the CLI's one-line message.
//!
//! Threads and signals: the engine computes with the interpreter released
//! (`Python::detach`), one token per release: a decode step on the calling thread or the
//! model's rayon pool ([`model::Shared::step`]), a prefill on the pool
//! ([`model::Shared::compute`]). Between two tokens the interpreter is re-attached and
//! pending signals run (`Python::check_signals`), so Ctrl-C raises `KeyboardInterrupt`
//! within one step. Steps take turns: threads that share a model (or models) interleave
//! token by token.
//!
//! Errors: library errors become `FileNotFoundError` (a missing file), `OSError` (other I/O),
//! `ValueError` (bad options, bad files, a prompt that does not fit) or `RuntimeError`
//! (non-finite values), carrying the message the CLI prints after "error: ". A panic is
//! caught where the engine is called and raised as `RuntimeError`; none reaches Python.

mod generation;
mod json;
mod model;

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tinygpt_cpu::Error;

/// The Python exception for an engine error, with the CLI's one-line message.
pub(crate) fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(msg)
        }
        Error::Io { .. } => PyOSError::new_err(msg),
        Error::NonFinite(_) | Error::Write { .. } | Error::Interrupted(_) => {
            PyRuntimeError::new_err(msg)
        }
        Error::Format { .. }
        | Error::Config { .. }
        | Error::Tensor { .. }
        | Error::Tokenizer { .. }
        | Error::Flag { .. }
        | Error::State { .. }
        | Error::Generate(_) => PyValueError::new_err(msg),
    }
}

/// A clap error (a flag's value the CLI would refuse) as `ValueError`, on one line:
/// clap's message without its "error: " prefix, usage and help hint.
pub(crate) fn flag_err(e: clap::Error) -> PyErr {
    let text = e.render().to_string();
    let line: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect();
    let line = line.join(" ");
    PyValueError::new_err(line.strip_prefix("error: ").unwrap_or(&line).to_string())
}

/// Runs `f`, turning a panic into `RuntimeError` (none may unwind into Python).
pub(crate) fn catch<T>(f: impl FnOnce() -> T) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        PyRuntimeError::new_err(format!("internal error in tinygpt-cpu: {what}"))
    })
}

/// The engine of the `tinygpt_cpu` package: a loaded model and its generations.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Load NumPy's C API now: rust-numpy loads it at the first array and panics if that
    // fails (say, a Ctrl-C during NumPy's import), so let a failure fail this import.
    catch(|| drop(numpy::PyArray1::<f32>::from_vec(m.py(), Vec::new())))?;
    m.add_class::<model::Model>()?;
    m.add_class::<generation::Generation>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
