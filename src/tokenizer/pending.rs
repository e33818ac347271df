//! A tokenizer built on its own thread while the weights load.
//!
//! Building the tokenizer of a 150–260K-entry vocabulary takes 0.3–0.8 s; checking and
//! repacking the weights takes as long again, and the two share nothing. So opening a model
//! starts the build on a thread of its own ([`PendingTokenizer::spawn`]) and returns; the
//! first caller of [`PendingTokenizer::get`] waits for it. The thread is a plain
//! `std::thread`, not a task on the rayon pool the weights load on: with `--threads 1` that
//! pool has one thread, and the tokenizer would wait behind the whole repack.
//!
//! A build that fails gives its error to every caller, as building it in place would have
//! (the same variant and message, naming the file); a build that panics gives an
//! [`Error::Tokenizer`] naming the file and the panic's message, not a panic.

use super::Tokenizer;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

/// A [`Tokenizer`] that may still be being built; [`get`](Self::get) waits for it.
pub struct PendingTokenizer {
    /// The build's result, once joined.
    built: OnceLock<Result<Tokenizer>>,
    /// The build's thread until it is joined.
    thread: Mutex<Option<JoinHandle<Result<Tokenizer>>>>,
    /// The file the tokenizer comes from, for the message of a build that panicked.
    path: PathBuf,
}

impl PendingTokenizer {
    /// A tokenizer built already (or its error).
    pub fn ready(built: Result<Tokenizer>, path: &Path) -> Self {
        PendingTokenizer {
            built: OnceLock::from(built),
            thread: Mutex::new(None),
            path: path.to_path_buf(),
        }
    }

    /// Runs `build(path)` on a thread of its own (in place when no thread can be started);
    /// `path` is the file the tokenizer comes from, for messages.
    pub fn spawn(
        path: &Path,
        build: impl FnOnce(&Path) -> Result<Tokenizer> + Send + 'static,
    ) -> Self {
        // `build` is moved into the closure only when the thread starts, so a refused
        // spawn (no memory, a thread limit) leaves nothing to retry with: keep it in a slot
        // the caller can take back.
        let slot = std::sync::Arc::new(Mutex::new(Some(build)));
        let (theirs, at) = (slot.clone(), path.to_path_buf());
        let started =
            std::thread::Builder::new()
                .name("tokenizer".into())
                .spawn(move || match lock(&theirs).take() {
                    Some(build) => build(&at),
                    None => Err(Error::tokenizer(at, "the tokenizer's build was lost")),
                });
        match started {
            Ok(handle) => PendingTokenizer {
                built: OnceLock::new(),
                thread: Mutex::new(Some(handle)),
                path: path.to_path_buf(),
            },
            Err(_) => {
                let build = lock(&slot).take();
                let built = match build {
                    Some(build) => build(path),
                    None => Err(Error::tokenizer(path, "the tokenizer's build was lost")),
                };
                Self::ready(built, path)
            }
        }
    }

    /// The tokenizer, once built (waiting for its thread the first time), or the build's
    /// error.
    pub fn get(&self) -> Result<&Tokenizer> {
        self.built
            .get_or_init(|| self.join())
            .as_ref()
            .map_err(Error::replay)
    }

    /// The build's error if it failed (waiting for it), else `e`: a file refused for two
    /// reasons names its tokenizer's, as when the tokenizer was built first.
    pub fn error_or(&self, e: Error) -> Error {
        self.get().err().unwrap_or(e)
    }

    /// Waits for the build; a panic in it becomes an error naming the file.
    fn join(&self) -> Result<Tokenizer> {
        let Some(handle) = lock(&self.thread).take() else {
            // `built` is set whenever no thread is left to join.
            return Err(Error::tokenizer(&self.path, "the tokenizer was not built"));
        };
        handle.join().unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Err(Error::tokenizer(
                &self.path,
                format!("building the tokenizer failed (it panicked: {what})"),
            ))
        })
    }
}

impl Drop for PendingTokenizer {
    /// Waits for a build never asked for, so no thread outlives the model files it reads.
    fn drop(&mut self) {
        if let Some(handle) = lock(&self.thread).take() {
            let _ = handle.join();
        }
    }
}

/// The mutex's value, even if a thread panicked holding it (the value is an `Option`
/// taken whole, never left half-written).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
