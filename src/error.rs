//! The engine's error type. Library code returns [`Result`]; only `main` prints.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file exists but its content is not what its format promises.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// The model configuration is missing a field or is inconsistent.
    #[error("{path}: invalid config: {msg}")]
    Config { path: PathBuf, msg: String },
    /// A tensor is missing, or has the wrong shape or dtype.
    #[error("{path}: tensor '{name}': {msg}")]
    Tensor {
        path: PathBuf,
        name: String,
        msg: String,
    },
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    /// A command-line value is out of range or inconsistent with another one.
    #[error("{flag}: {msg}")]
    Flag { flag: String, msg: String },
    /// Generation cannot continue (context exhausted, empty prompt, ...).
    #[error("{0}")]
    Generate(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(
        path: impl Into<PathBuf>,
        name: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            name: name.into(),
            msg: msg.into(),
        }
    }
    pub fn tokenizer(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Tokenizer {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn flag(flag: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Flag {
            flag: flag.into(),
            msg: msg.into(),
        }
    }
}

/// The engine's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
