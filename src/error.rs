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
    /// The model computed NaN or Inf: named by what went non-finite and where.
    #[error("{0}")]
    NonFinite(String),
    /// Writing a result failed (`stream` is "stdout" or "stderr"). A closed pipe
    /// ([`Error::is_broken_pipe`]) is not reported: the reader has gone away.
    #[error("writing to {stream}: {}", io_message(.source))]
    Write {
        stream: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The run was stopped by SIGINT (ctrl-c) after printing its partial results.
    #[error("interrupted ({0})")]
    Interrupted(String),
    /// A saved cache state ([`crate::state`]) that cannot be used here: `problem` says
    /// which check refused it, `msg` what differs.
    #[error("{path}: {msg}", path = .path.display())]
    State {
        path: PathBuf,
        problem: crate::state::Problem,
        msg: String,
    },
}

/// An I/O error's description without the " (os error N)" suffix.
pub fn io_message(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_string(),
        _ => s,
    }
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
    pub fn write(stream: &'static str, source: std::io::Error) -> Self {
        Error::Write { stream, source }
    }
    /// A write to a pipe whose reader has gone away (`| head`): the program stops quietly.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Error::Write { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe)
    }
    pub fn flag(flag: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Flag {
            flag: flag.into(),
            msg: msg.into(),
        }
    }

    /// The same error again, for a result handed to more than one caller (a tokenizer
    /// built once, [`crate::tokenizer::PendingTokenizer`]): the same variant, fields and
    /// message; an I/O error is rebuilt from its kind and message.
    pub fn replay(&self) -> Error {
        let io = |e: &std::io::Error| std::io::Error::new(e.kind(), e.to_string());
        match self {
            Error::Io { path, source } => Error::io(path, io(source)),
            Error::Format { path, msg } => Error::format(path, msg),
            Error::Config { path, msg } => Error::config(path, msg),
            Error::Tensor { path, name, msg } => Error::tensor(path, name, msg),
            Error::Tokenizer { path, msg } => Error::tokenizer(path, msg),
            Error::Flag { flag, msg } => Error::flag(flag, msg),
            Error::Generate(m) => Error::Generate(m.clone()),
            Error::NonFinite(m) => Error::NonFinite(m.clone()),
            Error::Write { stream, source } => Error::write(stream, io(source)),
            Error::Interrupted(m) => Error::Interrupted(m.clone()),
            Error::State { path, problem, msg } => Error::State {
                path: path.clone(),
                problem: *problem,
                msg: msg.clone(),
            },
        }
    }
}

/// The engine's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
