//! GGUF model files (llama.cpp's format), read as the engine reads a Hugging Face directory.
//!
//! [`GgufFile::open`] memory-maps the file and parses its header, metadata and tensor table
//! ([`reader`] documents the byte layout and the bounds-checking contract). From there:
//!
//! - [`GgufFile::config`] (`metadata.rs`): the `<arch>.*` keys as a validated
//!   [`Config`](crate::config::Config) (through
//!   [`HfConfig::validate`](crate::config::HfConfig::validate), so the checks are the ones
//!   `config.json` gets), cross-checked against the tensor shapes.
//! - [`GgufFile::hf_tensors`] (`names.rs`): the tensors under their Hugging Face names, in
//!   Hugging Face shape order, with llama.cpp's Q/K row permutation undone (llama only), so
//!   the forward pass is the same one as for a safetensors checkpoint. Data stays in its file dtype (quantised blocks included);
//!   [`crate::wkernels::dequant`] dequantises it.
//! - [`GgufFile::tokenizer`]: a `tokenizers::Tokenizer` built from `tokenizer.ggml.*`
//!   ([`tokenizer`] says how, and how it matches transformers' GGUF conversion).
//! - [`GgufFile::chat_template`]: `tokenizer.chat_template`, for [`crate::chat::render_chat`].
//!
//! The architectures accepted are the rows of [`ARCHS`]: `llama` (Llama, SmolLM,
//! Mistral-style files written as llama), `qwen2` (q/k/v biases), `qwen3` (per-head q/k
//! RMSNorm) and `gemma3` (Gemma 3 text: sandwich norms, GeGLU, sliding layers); their
//! metadata keys are read under their own prefix (`qwen3.block_count`).
//!
//! This file holds the opening, the architecture table and the raw accessors; the unit tests
//! of the private parts are in `tests.rs`.

mod metadata;
mod names;
pub mod reader;
#[cfg(test)]
mod tests;
pub mod tokenizer;

pub use names::unpermute_qk_rows;
pub use reader::{GgufArray, GgufValue, TensorInfo};

use crate::dtype::DType;
use crate::error::{Error, Result};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The bytes of a GGUF file: memory-mapped from disk, or owned (tests, fuzzing).
enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// Returns the pages of `map` covering `start..start + len` to the page cache (see
/// [`GgufFile::release`]): the process stops counting them in its resident set; a later
/// read faults them back in with the file's bytes. A refusal is ignored (a hint).
pub(crate) fn release_mapped(map: &memmap2::Mmap, start: usize, len: usize) {
    if len == 0 || start + len > map.len() {
        return;
    }
    // SAFETY: `MADV_DONTNEED` on a private, read-only file mapping that is never written
    // through drops the process's page-table entries only: a later access reads the same
    // bytes from the file (the page cache), so no borrowed slice of the mapping changes.
    // `advise_range` widens the range to whole pages, which only drops neighbours' pages
    // as well (re-read the same way).
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
}

/// An open GGUF file: its bytes, parsed metadata and checked tensor table.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    parsed: reader::Parsed,
    arch: &'static ArchSpec,
}

/// A tensor of a GGUF file, renamed and reshaped to its Hugging Face name and shape.
///
/// `shape` is in Hugging Face (PyTorch, row-major) order: `[out_features, in_features]` for a
/// linear weight, `[vocab, hidden]` for the embedding, `[n]` for norms and biases. `data` is in
/// the file's `dtype`, row-major: each row of `shape[last]` elements is a whole number of
/// blocks for quantised types (`dtype.bytes_for(row)` bytes per row). Q/K projections have been
/// un-permuted (and are therefore `Cow::Owned`); every other tensor borrows the file's bytes.
#[derive(Debug, Clone)]
pub struct GgufTensor<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl GgufTensor<'_> {
    /// Number of elements (product of `shape`).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values as f32 ([`crate::wkernels::dequantize_row`]).
    pub fn to_f32(&self) -> std::result::Result<Vec<f32>, crate::wkernels::DequantError> {
        let mut out = vec![0.0f32; self.n_elements()];
        crate::wkernels::dequantize_row(self.dtype, &self.data, &mut out)?;
        Ok(out)
    }
}

/// What the loader needs to know about one accepted `general.architecture`. Adding an
/// architecture whose forward pass the engine already runs is one row of [`ARCHS`].
#[derive(Debug, PartialEq, Eq)]
pub struct ArchSpec {
    /// `general.architecture`, also the prefix of its metadata keys (`qwen2.block_count`).
    pub name: &'static str,
    /// The Hugging Face `model_type` the file is read as (what
    /// [`HfConfig::validate`](crate::config::HfConfig::validate) checks).
    pub model_type: &'static str,
    /// llama.cpp's converter permuted the Q/K rows into interleaved-pair RoPE order (llama
    /// only): undone at load. The other architectures run NEOX-style RoPE (Hugging Face's
    /// `rotate_half`) and store Q/K as Hugging Face does.
    pub permuted_qk: bool,
    /// Per-head RMSNorm of q and k before RoPE (`blk.N.attn_q_norm.weight` /
    /// `attn_k_norm.weight`, length `head_dim`).
    pub qk_norm: bool,
    /// Gemma's norms around each block: `ffn_norm` is the MLP's input norm
    /// (`pre_feedforward_layernorm`), `post_attention_norm` / `post_ffw_norm` norm the
    /// attention and MLP outputs.
    pub sandwich_norms: bool,
}

/// The accepted architectures.
pub const ARCHS: &[ArchSpec] = &[
    ArchSpec {
        name: "llama",
        model_type: "llama",
        permuted_qk: true,
        qk_norm: false,
        sandwich_norms: false,
    },
    ArchSpec {
        name: "qwen2",
        model_type: "qwen2",
        permuted_qk: false,
        qk_norm: false,
        sandwich_norms: false,
    },
    ArchSpec {
        name: "qwen3",
        model_type: "qwen3",
        permuted_qk: false,
        qk_norm: true,
        sandwich_norms: false,
    },
    // Gemma 3 (text): embedding × √hidden, GeGLU, sandwich norms, per-head q/k norms,
    // every sixth layer global and the others sliding (`gemma3.attention.sliding_window`),
    // with RoPE base 10000 on the sliding layers, as llama.cpp fixes them for this
    // architecture. llama.cpp's converter stores Gemma's norm weights with the 1 already
    // added, so they are used as they are.
    ArchSpec {
        name: "gemma3",
        model_type: "gemma3_text",
        permuted_qk: false,
        qk_norm: true,
        sandwich_norms: true,
    },
];

fn arch_names() -> String {
    ARCHS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only and the map is private to this process and
        // never written through. As with every mmap-based loader (safetensors, llama.cpp), the
        // contract is that nobody truncates or rewrites the model file while it is open; doing
        // so is outside what this program can defend against (a SIGBUS or changed bytes, never
        // an out-of-bounds access: every slice taken is checked against the map's length).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::from_storage(Storage::Mmap(map), path)
    }

    /// Parses a GGUF file held in memory; `path_for_errors` names it in error messages.
    pub fn from_bytes(bytes: Vec<u8>, path_for_errors: &Path) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes), path_for_errors)
    }

    fn from_storage(storage: Storage, path: &Path) -> Result<GgufFile> {
        let parsed = reader::parse(storage.bytes(), path)?;
        let arch = match parsed.metadata.get("general.architecture") {
            None => {
                return Err(Error::format(
                    path,
                    "missing metadata 'general.architecture'",
                ))
            }
            Some(GgufValue::String(a)) => match ARCHS.iter().find(|s| s.name == a) {
                Some(spec) => spec,
                None => {
                    return Err(Error::format(
                        path,
                        format!(
                            "general.architecture '{a}' is not supported (supported: {})",
                            arch_names()
                        ),
                    ))
                }
            },
            Some(v) => {
                return Err(Error::format(
                    path,
                    format!(
                        "metadata 'general.architecture' is a {}, expected a string",
                        v.type_name()
                    ),
                ))
            }
        };
        Ok(GgufFile {
            path: path.to_path_buf(),
            storage,
            parsed,
            arch,
        })
    }

    /// The whole file's bytes (tensor data borrowed by [`hf_tensors`](Self::hf_tensors)
    /// points into these).
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Lets the kernel drop the resident pages of `start..start + len` (bytes of the
    /// file): a tensor repacked at load, or checked and not read again, stops counting
    /// twice in the resident set. The bytes read the same afterwards (a read faults them
    /// back in from the page cache); owned storage is left as it is.
    pub fn release(&self, start: usize, len: usize) {
        if let Storage::Mmap(m) = &self.storage {
            release_mapped(m, start, len);
        }
    }

    /// The file's architecture (`general.architecture`, one of [`ARCHS`]).
    pub fn arch(&self) -> &'static ArchSpec {
        self.arch
    }

    /// `<arch>.<suffix>`: a metadata key of this file's architecture.
    fn k(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch.name)
    }

    /// The path given to [`open`](Self::open) / [`from_bytes`](Self::from_bytes).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.parsed.version
    }

    /// All metadata key/value pairs.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.parsed.metadata
    }

    /// The tensor table, in file order, with GGUF names and `ne` order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.parsed.tensors
    }

    /// Alignment of the data section (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.parsed.alignment
    }

    /// Absolute offset of the data section in the file.
    pub fn data_offset(&self) -> usize {
        self.parsed.data_offset
    }

    /// The raw bytes of a tensor of this file (bounds were checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        self.storage
            .bytes()
            .get(t.start..t.start + t.n_bytes)
            .unwrap_or(&[])
    }

    /// Looks a tensor up by its GGUF name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.parsed.tensors.iter().find(|t| t.name == name)
    }

    /// `tokenizer.chat_template`, if the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.parsed
            .metadata
            .get("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
    }

    /// Builds the tokenizer described by `tokenizer.ggml.*` (see [`tokenizer`]).
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        tokenizer::build(&self.parsed.metadata, &self.path)
    }
}
