//! The model configuration from a GGUF file's metadata: [`GgufFile::config`] reads the
//! `<arch>.*` keys (and `tokenizer.ggml.*` ids) into an [`HfConfig`], has it validated as
//! `config.json` is, and cross-checks it against the tensor table (names and shapes). The
//! typed getters here are also what [`GgufFile::hf_tensors`] reads the head counts with.

use super::names::{block_index, hf_name_for};
use super::{GgufArray, GgufFile, GgufValue};
use crate::config::{Config, HfConfig, TokenIds};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::collections::BTreeMap;

impl GgufFile {
    fn cfg_err(&self, msg: impl Into<String>) -> Error {
        Error::config(&self.path, msg)
    }

    /// An optional non-negative integer key.
    pub(super) fn get_usize(&self, key: &str) -> Result<Option<usize>> {
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

    pub(super) fn require_usize(&self, key: &str) -> Result<usize> {
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
}

fn describe(v: &GgufValue) -> String {
    match v {
        GgufValue::String(s) => format!("the string {s:?}"),
        GgufValue::Array(a) => format!("an array of {} {}", a.len(), a.elem_type_name()),
        other => format!("{other:?}"),
    }
}

/// Gemma 3's `query_pre_attn_scalar`, which a GGUF has no key for: llama.cpp scales 27B (62
/// blocks) by `1/√(n_embd / n_head)` (integer division), every other size by `1/√head_dim`
/// (`None` here).
pub(super) fn gemma3_query_pre_attn_scalar(
    n_layers: usize,
    hidden: usize,
    n_heads: usize,
) -> Option<f64> {
    (n_layers == 62 && n_heads > 0).then(|| (hidden / n_heads) as f64)
}
