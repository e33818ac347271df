//! GGUF model files (llama.cpp's format), read as the engine reads a Hugging Face directory.
//!
//! [`GgufFile::open`] memory-maps the file and parses its header, metadata and tensor table
//! ([`reader`] documents the byte layout and the bounds-checking contract). From there:
//!
//! - [`GgufFile::config`]: the `<arch>.*` keys as a validated [`Config`] (through
//!   [`HfConfig::validate`], so the checks are the ones `config.json` gets), cross-checked
//!   against the tensor shapes.
//! - [`GgufFile::hf_tensors`]: the tensors under their Hugging Face names, in Hugging Face shape
//!   order, with llama.cpp's Q/K row permutation undone (llama only), so the forward pass is the same one as
//!   for a safetensors checkpoint. Data stays in its file dtype (quantised blocks included);
//!   [`crate::wkernels::dequant`] dequantises it.
//! - [`GgufFile::tokenizer`]: a `tokenizers::Tokenizer` built from `tokenizer.ggml.*`
//!   ([`tokenizer`] says how, and how it matches transformers' GGUF conversion).
//! - [`GgufFile::chat_template`]: `tokenizer.chat_template`, for [`crate::chat::render_chat`].
//!
//! The architectures accepted are the rows of [`ARCHS`]: `llama` (Llama, SmolLM,
//! Mistral-style files written as llama), `qwen2` (q/k/v biases) and `qwen3` (per-head q/k
//! RMSNorm); their metadata keys are read under their own prefix (`qwen3.block_count`).

pub mod reader;
pub mod tokenizer;

pub use reader::{GgufArray, GgufValue, TensorInfo};

use crate::config::{Config, HfConfig, TokenIds};
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

/// Which llama.cpp row permutation a tensor carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Permuted {
    No,
    /// q_proj: permuted with `n_head`.
    Q,
    /// k_proj: permuted with `n_head_kv`.
    K,
}

/// What the loader needs to know about one accepted `general.architecture`. Adding an
/// architecture whose forward pass the engine already runs is one row of [`ARCHS`].
#[derive(Debug, PartialEq, Eq)]
pub struct ArchSpec {
    /// `general.architecture`, also the prefix of its metadata keys (`qwen2.block_count`).
    pub name: &'static str,
    /// The Hugging Face `model_type` the file is read as (what [`HfConfig::validate`] checks).
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

    fn cfg_err(&self, msg: impl Into<String>) -> Error {
        Error::config(&self.path, msg)
    }

    /// An optional non-negative integer key.
    fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.parsed.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.cfg_err(format!(
                        "metadata '{key}' must be a non-negative integer, got {}",
                        describe(v)
                    ))
                }),
        }
    }

    fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.parsed.metadata.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                self.cfg_err(format!(
                    "metadata '{key}' must be a number, got {}",
                    describe(v)
                ))
            }),
        }
    }

    fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.parsed.metadata.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| {
                self.cfg_err(format!(
                    "metadata '{key}' must be a string, got {}",
                    describe(v)
                ))
            }),
        }
    }

    fn require_usize(&self, key: &str) -> Result<usize> {
        self.get_usize(key)?
            .ok_or_else(|| self.cfg_err(format!("missing metadata '{key}'")))
    }

    /// The model configuration from the `<arch>.*` metadata, validated by
    /// [`HfConfig::validate`] and cross-checked against the tensor shapes.
    ///
    /// - `head_dim` = `<arch>.attention.key_length`, else `<arch>.rope.dimension_count`, else
    ///   `embedding_length / head_count`; a rope dimension count different from `head_dim`
    ///   (partial rotary) is refused.
    /// - `vocab_size` = `<arch>.vocab_size`, else the length of `tokenizer.ggml.tokens`, else the
    ///   rows of `token_embd.weight`.
    /// - `tie_word_embeddings` = there is no `output.weight` tensor (the LM head is then the
    ///   embedding matrix, as in SmolLM2).
    /// - `attention_bias` = the file has `attn_q.bias` tensors.
    /// - `qk_norm` = the architecture has per-head q/k norms ([`ArchSpec::qk_norm`], through
    ///   the `model_type` it is read as); the `attn_{q,k}_norm.weight` tensors are then required.
    /// - RoPE scaling: `<arch>.rope.scaling.type` = `linear` with `<arch>.rope.scaling.factor`
    ///   (or the older `<arch>.rope.scale_linear`); a `rope_freqs.weight` tensor (Llama 3.1/3.2)
    ///   is recognised as Llama 3 scaling when it equals the factors that scheme gives.
    /// - gemma3: `gemma3.final_logit_softcapping` caps the logits (a finite number > 0);
    ///   `gemma3.attn_logit_softcapping` is refused.
    pub fn config(&self) -> Result<Config> {
        let k = |s: &str| self.k(s);
        let hidden = self.require_usize(&k("embedding_length"))?;
        let n_layers = self.require_usize(&k("block_count"))?;
        let n_heads = self.require_usize(&k("attention.head_count"))?;
        let n_kv_heads = self.get_usize(&k("attention.head_count_kv"))?;
        let ffn = self.require_usize(&k("feed_forward_length"))?;
        let key_length = self.get_usize(&k("attention.key_length"))?;
        let value_length = self.get_usize(&k("attention.value_length"))?;
        let rope_dims = self.get_usize(&k("rope.dimension_count"))?;
        let head_dim = key_length.or(rope_dims);
        if let (Some(kl), Some(vl)) = (key_length, value_length) {
            if kl != vl {
                return Err(self.cfg_err(format!(
                    "attention.key_length ({kl}) != attention.value_length ({vl}) is not supported"
                )));
            }
        }
        if let (Some(hd), Some(rd)) = (head_dim, rope_dims) {
            if hd != rd {
                return Err(self.cfg_err(format!(
                    "{} ({rd}) differs from the head dimension ({hd}): partial rotary embeddings are not supported",
                    k("rope.dimension_count")
                )));
            }
        }
        let vocab = match self.get_usize(&k("vocab_size"))? {
            Some(v) => Some(v),
            None => match self.parsed.metadata.get("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(a)) => Some(a.len()),
                _ => self
                    .tensor("token_embd.weight")
                    .and_then(|t| t.ne.get(1).copied()),
            },
        };
        let rope_theta = self.get_f64(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let eps = self.get_f64(&k("attention.layer_norm_rms_epsilon"))?;
        let ctx = self.get_usize(&k("context_length"))?;
        if ctx == Some(0) {
            return Err(self.cfg_err(format!(
                "{} is 0 (the context length must be > 0)",
                k("context_length")
            )));
        }
        let bos = self.get_usize("tokenizer.ggml.bos_token_id")?;
        let eos = self.get_usize("tokenizer.ggml.eos_token_id")?;
        let to_u32 = |x: usize, key: &str| {
            u32::try_from(x)
                .map_err(|_| self.cfg_err(format!("metadata '{key}' = {x} is too large")))
        };
        let bos = bos
            .map(|b| to_u32(b, "tokenizer.ggml.bos_token_id"))
            .transpose()?;
        let eos = eos
            .map(|e| to_u32(e, "tokenizer.ggml.eos_token_id"))
            .transpose()?;
        let rope_scaling = self.rope_scaling(rope_theta, head_dim.unwrap_or(0))?;
        let tied = self.tensor("output.weight").is_none();
        let attention_bias = self.tensor("blk.0.attn_q.bias").is_some();
        let (layer_types, mut sliding_window, shared) = self.layer_plan(n_layers)?;
        let gemma3 = self.arch.name == "gemma3";
        if gemma3 && layer_types.is_none() {
            sliding_window = self
                .get_usize(&k("attention.sliding_window"))?
                .map(serde_json::Value::from);
        }
        let final_softcap = match gemma3 {
            true => self.final_logit_softcapping()?,
            false => None,
        };

        let hf = HfConfig {
            model_type: Some(self.arch.model_type.to_string()),
            vocab_size: vocab,
            hidden_size: Some(hidden),
            num_hidden_layers: Some(n_layers),
            num_attention_heads: Some(n_heads),
            num_key_value_heads: n_kv_heads,
            head_dim,
            intermediate_size: Some(ffn),
            rms_norm_eps: eps,
            rope_theta: Some(rope_theta),
            rope_scaling,
            max_position_embeddings: ctx,
            tie_word_embeddings: Some(tied),
            attention_bias: Some(attention_bias),
            hidden_act: (!gemma3).then(|| "silu".into()),
            hidden_activation: gemma3.then(|| "gelu_pytorch_tanh".into()),
            bos_token_id: bos.map(TokenIds::One),
            eos_token_id: eos.map(TokenIds::One),
            layer_types,
            sliding_window,
            num_kv_shared_layers: shared,
            query_pre_attn_scalar: gemma3
                .then(|| gemma3_query_pre_attn_scalar(n_layers, hidden, n_heads))
                .flatten(),
            final_logit_softcapping: final_softcap,
            from_gguf: true,
            ..HfConfig::default()
        };
        let mut cfg = hf.validate(&self.path)?;
        // GGUF norm weights are the multipliers themselves (llama.cpp's converter adds
        // Gemma's 1).
        cfg.gemma.norm_offset = 0.0;
        // Every id the tokenizer can produce must index the embedding.
        if let Some(GgufValue::Array(tokens)) = self.parsed.metadata.get("tokenizer.ggml.tokens") {
            if tokens.len() > cfg.vocab_size {
                return Err(self.cfg_err(format!(
                    "tokenizer.ggml.tokens has {} tokens but the vocabulary size is {}",
                    tokens.len(),
                    cfg.vocab_size
                )));
            }
        }
        for (what, id) in [("bos", cfg.bos_token_id)]
            .into_iter()
            .chain(cfg.eos_token_ids.iter().map(|&e| ("eos", Some(e))))
        {
            if let Some(id) = id.filter(|&id| id as usize >= cfg.vocab_size) {
                return Err(self.cfg_err(format!(
                    "tokenizer.ggml.{what}_token_id {id} is outside the vocabulary ({})",
                    cfg.vocab_size
                )));
            }
        }
        self.check_shapes(&cfg)?;
        Ok(cfg)
    }

    /// `<arch>.final_logit_softcapping` (llama.cpp's key), checked here so the error names
    /// it: a finite cap > 0 (as f32, the type it is applied in). `<arch>.attn_logit_softcapping`
    /// (attention score capping, Gemma 2's) is refused.
    fn final_logit_softcapping(&self) -> Result<Option<f64>> {
        let attn = self.k("attn_logit_softcapping");
        if let Some(v) = self.get_f64(&attn)? {
            return Err(self.cfg_err(format!(
                "{attn} = {v} is not supported (attention score soft-capping)"
            )));
        }
        let key = self.k("final_logit_softcapping");
        match self.get_f64(&key)? {
            Some(c) if !((c as f32).is_finite() && c as f32 > 0.0) => {
                Err(self.cfg_err(format!("{key} must be a finite number > 0, got {c}")))
            }
            c => Ok(c),
        }
    }

    /// `rope_scaling` in config.json form, from the GGUF keys or the `rope_freqs` tensor.
    fn rope_scaling(&self, theta: f64, head_dim: usize) -> Result<Option<serde_json::Value>> {
        let kind = self.get_str(&self.k("rope.scaling.type"))?;
        let factor = self.get_f64(&self.k("rope.scaling.factor"))?;
        let scale_linear = self.get_f64(&self.k("rope.scale_linear"))?;
        let from_keys = match (kind, factor, scale_linear) {
            (Some("none"), _, _) | (None, None, None) => None,
            (Some("linear") | None, Some(f), _) | (Some("linear") | None, None, Some(f)) => {
                Some(serde_json::json!({ "type": "linear", "factor": f }))
            }
            (Some("linear"), None, _) => {
                return Err(self.cfg_err(format!(
                    "{} is 'linear' but {} is missing",
                    self.k("rope.scaling.type"),
                    self.k("rope.scaling.factor")
                )))
            }
            (Some(other), _, _) => {
                return Err(self.cfg_err(format!(
                    "{} '{other}' is not supported (supported: none, linear)",
                    self.k("rope.scaling.type")
                )))
            }
        };
        let Some(t) = self.tensor("rope_freqs.weight") else {
            return Ok(from_keys);
        };
        if from_keys.is_some() {
            return Err(self.cfg_err("both rope scaling keys and a rope_freqs.weight tensor"));
        }
        let tensor_err = |msg: String| Error::tensor(&self.path, "rope_freqs.weight", msg);
        if t.dtype != DType::F32 || t.n_elements() * 2 != head_dim {
            return Err(tensor_err(format!(
                "expected F32 [{}], got {} {:?}",
                head_dim / 2,
                t.dtype,
                t.shape()
            )));
        }
        let freqs: Vec<f32> = self
            .tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let factor = freqs.iter().copied().fold(f32::MIN, f32::max) as f64;
        let orig_ctx = self
            .get_usize(&self.k("rope.scaling.original_context_length"))?
            .unwrap_or(8192);
        let (low, high) = (1.0f64, 4.0f64);
        // The divisors convert_hf_to_gguf writes for Llama 3 scaling.
        let expected = (0..head_dim / 2).map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let (lw, hw) = (orig_ctx as f64 / low, orig_ctx as f64 / high);
            if wavelen < hw {
                1.0
            } else if wavelen > lw {
                factor
            } else {
                let smooth = (orig_ctx as f64 / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        });
        let matches = freqs
            .iter()
            .zip(expected)
            .all(|(&got, want)| ((got as f64) - want).abs() <= 1e-3 * want.abs().max(1.0));
        if !matches {
            return Err(tensor_err(
                "rope frequency factors do not match Llama 3 rope scaling (low 1, high 4); other schemes are not supported".into(),
            ));
        }
        Ok(Some(serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig_ctx,
        })))
    }

    /// YOCO sharing and per-layer attention types, under llama.cpp's keys (as its Gemma 3n
    /// and Gemma 4 files spell them): `llama.attention.shared_kv_layers` (the last S layers
    /// reuse K/V), `llama.attention.sliding_window_pattern` (one bool per layer, `true` =
    /// sliding) and `llama.attention.sliding_window` (their window). Returned as the
    /// config.json values they stand for (`layer_types`, `sliding_window`,
    /// `num_kv_shared_layers`), which [`HfConfig::validate`] checks. Without a pattern,
    /// `sliding_window` is not read (this engine's llama GGUF files never had one).
    #[allow(clippy::type_complexity)]
    fn layer_plan(
        &self,
        n_layers: usize,
    ) -> Result<(
        Option<serde_json::Value>,
        Option<serde_json::Value>,
        Option<serde_json::Value>,
    )> {
        let shared = self
            .get_usize(&self.k("attention.shared_kv_layers"))?
            .map(serde_json::Value::from);
        let pattern_key = self.k("attention.sliding_window_pattern");
        let Some(pattern) = self.parsed.metadata.get(&pattern_key) else {
            return Ok((None, None, shared));
        };
        let bools = match pattern {
            GgufValue::Array(GgufArray::Bool(b)) => b,
            other => {
                return Err(self.cfg_err(format!(
                    "metadata '{pattern_key}' must be an array of bool, got {}",
                    describe(other)
                )))
            }
        };
        if bools.len() != n_layers {
            return Err(self.cfg_err(format!(
                "metadata '{pattern_key}' has {} entries but {} is {n_layers}",
                bools.len(),
                self.k("block_count")
            )));
        }
        let types = bools
            .iter()
            .map(|&sliding| match sliding {
                true => "sliding_attention",
                false => "full_attention",
            })
            .collect::<Vec<_>>();
        let window = self
            .get_usize(&self.k("attention.sliding_window"))?
            .map(serde_json::Value::from);
        Ok((Some(serde_json::Value::from(types)), window, shared))
    }

    /// Checks every tensor's name and shape against `cfg`; errors name the tensor.
    fn check_shapes(&self, cfg: &Config) -> Result<()> {
        let h = cfg.hidden_size;
        // Each layer has at least 9 tensors: a block count the table cannot hold is reported
        // before anything is built per layer (a hostile count must not allocate).
        if cfg.n_layers > self.parsed.tensors.len() {
            let first_missing = (0..=self.parsed.tensors.len())
                .find(|i| self.tensor(&format!("blk.{i}.attn_norm.weight")).is_none())
                .unwrap_or(0);
            return Err(Error::tensor(
                &self.path,
                format!("blk.{first_missing}.attn_norm.weight"),
                format!(
                    "missing: {} is {} but the file has {} tensors",
                    self.k("block_count"),
                    cfg.n_layers,
                    self.parsed.tensors.len()
                ),
            ));
        }
        let mut expected: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        expected.insert("token_embd.weight".into(), vec![cfg.vocab_size, h]);
        expected.insert("output_norm.weight".into(), vec![h]);
        if !cfg.tie_word_embeddings {
            expected.insert("output.weight".into(), vec![cfg.vocab_size, h]);
        }
        // attn_k/attn_v of a YOCO shared layer may be absent (ignored if present).
        let mut optional: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for i in 0..cfg.n_layers {
            let b = |s: &str| format!("blk.{i}.{s}");
            let kv_map = match i < cfg.layers_with_kv() {
                true => &mut expected,
                false => &mut optional,
            };
            kv_map.insert(b("attn_k.weight"), vec![cfg.kv_dim(), h]);
            kv_map.insert(b("attn_v.weight"), vec![cfg.kv_dim(), h]);
            if cfg.attention_bias {
                kv_map.insert(b("attn_k.bias"), vec![cfg.kv_dim()]);
                kv_map.insert(b("attn_v.bias"), vec![cfg.kv_dim()]);
            }
            if cfg.qk_norm {
                kv_map.insert(b("attn_k_norm.weight"), vec![cfg.head_dim]);
            }
            expected.insert(b("attn_norm.weight"), vec![h]);
            expected.insert(b("ffn_norm.weight"), vec![h]);
            if cfg.gemma.sandwich_norms {
                expected.insert(b("post_attention_norm.weight"), vec![h]);
                expected.insert(b("post_ffw_norm.weight"), vec![h]);
            }
            expected.insert(b("attn_q.weight"), vec![cfg.q_dim(), h]);
            expected.insert(b("attn_output.weight"), vec![h, cfg.q_dim()]);
            expected.insert(b("ffn_gate.weight"), vec![cfg.intermediate_size, h]);
            expected.insert(b("ffn_up.weight"), vec![cfg.intermediate_size, h]);
            expected.insert(b("ffn_down.weight"), vec![h, cfg.intermediate_size]);
            if cfg.attention_bias {
                expected.insert(b("attn_q.bias"), vec![cfg.q_dim()]);
            }
            if cfg.qk_norm {
                expected.insert(b("attn_q_norm.weight"), vec![cfg.head_dim]);
            }
        }
        for t in &self.parsed.tensors {
            if t.name == "rope_freqs.weight" {
                continue; // checked by rope_scaling()
            }
            let Some(want) = expected
                .remove(&t.name)
                .or_else(|| optional.remove(&t.name))
            else {
                let msg = match block_index(&t.name) {
                    Some(n) if n >= cfg.n_layers => format!(
                        "layer {n} does not exist: {} is {}",
                        self.k("block_count"),
                        cfg.n_layers
                    ),
                    _ if hf_name_for(&t.name, self.arch.sandwich_norms).is_some() => {
                        "unexpected for this configuration (e.g. a bias without attn_q.bias in blk.0)".into()
                    }
                    _ => format!("not a tensor of the {} architecture", self.arch.name),
                };
                return Err(Error::tensor(&self.path, &t.name, msg));
            };
            let got = t.shape();
            if got != want {
                return Err(Error::tensor(
                    &self.path,
                    &t.name,
                    format!("shape {got:?} contradicts the metadata, which implies {want:?}"),
                ));
            }
        }
        if let Some((name, want)) = expected.into_iter().next() {
            return Err(Error::tensor(
                &self.path,
                name,
                format!(
                    "missing (expected shape {want:?} for {} = {})",
                    self.k("block_count"),
                    cfg.n_layers
                ),
            ));
        }
        Ok(())
    }

    /// Every tensor under its Hugging Face name and shape, Q/K un-permuted (see [`GgufTensor`]).
    ///
    /// `rope_freqs.weight` is not returned (it is folded into [`config`](Self::config)'s RoPE
    /// scaling). Call [`config`](Self::config) first to have the shapes validated; this method
    /// only needs the head counts.
    pub fn hf_tensors(&self) -> Result<Vec<GgufTensor<'_>>> {
        let n_head = self.require_usize(&self.k("attention.head_count"))?;
        let n_head_kv = self
            .get_usize(&self.k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        let mut out = Vec::with_capacity(self.parsed.tensors.len());
        for t in &self.parsed.tensors {
            if t.name == "rope_freqs.weight" {
                continue;
            }
            let (name, perm) = hf_name_for(&t.name, self.arch.sandwich_norms).ok_or_else(|| {
                Error::tensor(
                    &self.path,
                    &t.name,
                    format!("not a tensor of the {} architecture", self.arch.name),
                )
            })?;
            let bytes = self.tensor_data(t);
            let shape = t.shape();
            let perm = if self.arch.permuted_qk {
                perm
            } else {
                Permuted::No
            };
            let data = match perm {
                Permuted::No => Cow::Borrowed(bytes),
                Permuted::Q | Permuted::K => {
                    let heads = if perm == Permuted::Q {
                        n_head
                    } else {
                        n_head_kv
                    };
                    let rows = shape[0];
                    unpermute_qk_rows(bytes, rows, heads)
                        .map(Cow::Owned)
                        .map_err(|msg| Error::tensor(&self.path, &t.name, msg))?
                }
            };
            out.push(GgufTensor {
                name,
                dtype: t.dtype,
                shape,
                data,
            });
        }
        Ok(out)
    }
}

fn describe(v: &GgufValue) -> String {
    match v {
        GgufValue::String(s) => format!("the string {s:?}"),
        GgufValue::Array(a) => format!("an array of {} {}", a.len(), a.elem_type_name()),
        other => format!("{other:?}"),
    }
}

/// `N` of a `blk.N.` tensor name.
fn block_index(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The Hugging Face name of a GGUF llama tensor, and whether llama.cpp permuted its rows.
#[cfg(test)]
fn hf_name(gguf: &str) -> Option<(String, Permuted)> {
    hf_name_for(gguf, false)
}

/// The Hugging Face name of a GGUF tensor of an architecture with or without Gemma's
/// sandwich norms, and whether llama.cpp permuted its rows (for llama).
fn hf_name_for(gguf: &str, sandwich: bool) -> Option<(String, Permuted)> {
    let global = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = global {
        return Some((n.to_string(), Permuted::No));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (idx, rest) = rest.split_once('.')?;
    let i: usize = idx.parse().ok()?;
    if idx != i.to_string() {
        return None; // "blk.01." and friends
    }
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (hf, perm) = match part {
        "attn_norm" => ("input_layernorm", Permuted::No),
        "ffn_norm" if sandwich => ("pre_feedforward_layernorm", Permuted::No),
        "ffn_norm" => ("post_attention_layernorm", Permuted::No),
        "post_attention_norm" if sandwich => ("post_attention_layernorm", Permuted::No),
        "post_ffw_norm" if sandwich => ("post_feedforward_layernorm", Permuted::No),
        "attn_q" => ("self_attn.q_proj", Permuted::Q),
        "attn_k" => ("self_attn.k_proj", Permuted::K),
        "attn_v" => ("self_attn.v_proj", Permuted::No),
        "attn_output" => ("self_attn.o_proj", Permuted::No),
        "attn_q_norm" => ("self_attn.q_norm", Permuted::No),
        "attn_k_norm" => ("self_attn.k_norm", Permuted::No),
        "ffn_gate" => ("mlp.gate_proj", Permuted::No),
        "ffn_up" => ("mlp.up_proj", Permuted::No),
        "ffn_down" => ("mlp.down_proj", Permuted::No),
        _ => return None,
    };
    if suffix == "bias" && part.ends_with("norm") {
        return None;
    }
    Some((format!("model.layers.{i}.{hf}.{suffix}"), perm))
}

/// Undoes llama.cpp's rotary row permutation of a Q or K projection (weight or bias).
///
/// `convert_hf_to_gguf.py` stores `permute(W, n_head)`:
/// `W.reshape(n_head, 2, head_dim / 2, ...).swapaxes(1, 2).reshape(W.shape)`, so that RoPE can
/// rotate adjacent pairs. Within each head, file row `2 j + half` holds Hugging Face row
/// `half · head_dim/2 + j` (`half` ∈ {0, 1}, `j` < head_dim/2). This function returns the
/// Hugging Face order: `out[h·hd + half·hd/2 + j] = in[h·hd + 2j + half]`.
///
/// It moves whole rows of `bytes.len() / n_rows` bytes, so it works for any dtype, including
/// quantised blocks (a row is a whole number of blocks). Errors (as a message) when the rows
/// cannot be split into `n_head` heads of an even number of rows.
pub fn unpermute_qk_rows(bytes: &[u8], n_rows: usize, n_head: usize) -> Result<Vec<u8>, String> {
    let heads_ok = n_head
        .checked_mul(2)
        .is_some_and(|two_h| n_rows.is_multiple_of(two_h));
    if n_head == 0 || n_rows == 0 || !heads_ok || !bytes.len().is_multiple_of(n_rows) {
        return Err(format!(
            "cannot undo the rotary row permutation: {n_rows} rows ({} bytes) are not {n_head} heads of an even number of rows",
            bytes.len()
        ));
    }
    let row = bytes.len() / n_rows;
    let hd = n_rows / n_head;
    let half_hd = hd / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for j in 0..half_hd {
            for half in 0..2 {
                let src = h * hd + 2 * j + half;
                let dst = h * hd + half * half_hd + j;
                out[dst * row..(dst + 1) * row].copy_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.attn_q.weight",
                "model.layers.12.self_attn.q_proj.weight",
            ),
            ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.3.ffn_gate.weight",
                "model.layers.3.mlp.gate_proj.weight",
            ),
            ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
        ];
        for (g, h) in cases {
            assert_eq!(hf_name(g).map(|x| x.0).as_deref(), Some(h), "{g}");
        }
        assert_eq!(hf_name("blk.0.attn_q.weight").unwrap().1, Permuted::Q);
        assert_eq!(hf_name("blk.0.attn_k.weight").unwrap().1, Permuted::K);
        assert_eq!(hf_name("blk.0.attn_v.weight").unwrap().1, Permuted::No);
        for bad in [
            "blk.x.attn_q.weight",
            "blk.01.attn_q.weight",
            "blk.0.attn_q",
            "blk.0.ssm_a",
            "rope_freqs.weight",
            "blk.0.attn_norm.bias",
        ] {
            assert!(hf_name(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn unpermute_moves_whole_rows() {
        // 1 head of 4 rows, 2 bytes per row: file rows [r0, r2, r1, r3] in HF terms.
        let file = [0, 0, 2, 2, 1, 1, 3, 3];
        assert_eq!(
            unpermute_qk_rows(&file, 4, 1).unwrap(),
            vec![0, 0, 1, 1, 2, 2, 3, 3]
        );
        assert!(unpermute_qk_rows(&file, 4, 3).is_err());
        assert!(unpermute_qk_rows(&file, 0, 1).is_err());
        assert!(unpermute_qk_rows(&file[..7], 4, 1).is_err());
    }
}

/// Gemma 3's `query_pre_attn_scalar`, which a GGUF has no key for: llama.cpp scales 27B (62
/// blocks) by `1/√(n_embd / n_head)` (integer division), every other size by `1/√head_dim`
/// (`None` here).
fn gemma3_query_pre_attn_scalar(n_layers: usize, hidden: usize, n_heads: usize) -> Option<f64> {
    (n_layers == 62 && n_heads > 0).then(|| (hidden / n_heads) as f64)
}

#[cfg(test)]
mod gemma3_scale_tests {
    use super::gemma3_query_pre_attn_scalar as qpas;

    #[test]
    fn only_27b_takes_embd_over_heads() {
        // Gemma 3 27B: 5376 / 32 = 168 (its Hugging Face config's value), head_dim 128.
        assert_eq!(qpas(62, 5376, 32), Some(168.0));
        // 270M, 1B (1152 / 4 = 288, yet scaled by head_dim 256), 4B, 12B.
        for (layers, hidden, heads) in [(18, 640, 4), (26, 1152, 4), (34, 2560, 8), (48, 3840, 16)]
        {
            assert_eq!(qpas(layers, hidden, heads), None);
        }
    }
}

#[cfg(test)]
mod softcap_tests {
    use super::*;

    /// The tiny Gemma 3 GGUF fixture (`fixtures/make_gguf_archs.py`), with `edit` applied to
    /// its metadata, then its config.
    fn gemma3_config(edit: impl FnOnce(&mut BTreeMap<String, GgufValue>)) -> Result<Config> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/archs/gemma3/gemma3.gguf");
        let mut f = GgufFile::open(&path).unwrap();
        edit(&mut f.parsed.metadata);
        f.config()
    }

    #[test]
    fn final_logit_softcapping_is_read() {
        assert_eq!(
            gemma3_config(|_| {}).unwrap().gemma.final_logit_softcapping,
            None
        );
        for (v, want) in [
            (GgufValue::F32(30.0), 30.0f32),
            (GgufValue::F32(0.25), 0.25),
            // llama.cpp writes f32; any number is read
            (GgufValue::F64(5.0), 5.0),
            (GgufValue::U32(7), 7.0),
        ] {
            let c = gemma3_config(|m| {
                m.insert("gemma3.final_logit_softcapping".into(), v.clone());
            })
            .unwrap();
            assert_eq!(c.gemma.final_logit_softcapping, Some(want), "{v:?}");
        }
    }

    #[test]
    fn bad_softcapping_values_are_refused_naming_key_and_file() {
        let key = "gemma3.final_logit_softcapping";
        for v in [
            GgufValue::F32(0.0),
            GgufValue::F32(-0.0),
            GgufValue::F32(-5.0),
            GgufValue::F32(f32::NAN),
            GgufValue::F32(f32::INFINITY),
            GgufValue::F64(1e300), // infinite as f32, the type it is applied in
            GgufValue::F64(1e-300), // 0 as f32
            GgufValue::I32(-1),
        ] {
            let e = gemma3_config(|m| {
                m.insert(key.into(), v.clone());
            })
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("gemma3.gguf") && e.contains(key) && e.contains("> 0"),
                "{v:?}: {e}"
            );
        }
        let e = gemma3_config(|m| {
            m.insert(key.into(), GgufValue::String("30".into()));
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains(key) && e.contains("must be a number"), "{e}");
        let attn = "gemma3.attn_logit_softcapping";
        let e = gemma3_config(|m| {
            m.insert(attn.into(), GgufValue::F32(50.0));
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("gemma3.gguf") && e.contains(attn) && e.contains("not supported"),
            "{e}"
        );
    }
}
