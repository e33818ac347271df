//! Model configuration, stage one: [`HfConfig`] mirrors a Hugging Face `config.json`
//! field for field; [`HfConfig::validate`] checks it into the [`Config`] the engine shares
//! with the scalar reference (`tinygpt-types`), with derived sizes computed once (GGUF
//! metadata is mapped onto an `HfConfig` first, so both formats get the same checks).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
pub use tinygpt_types::config::{AttentionType, Config, GemmaOptions, RopeScaling};

/// `eos_token_id` may be one id or a list of ids.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(x) => vec![*x],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// `config.json` of a Llama-family model, as written by transformers.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub intermediate_size: Option<usize>,
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 4.5x may nest `rope_theta` and scaling here instead.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub sliding_window: Option<serde_json::Value>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Per-layer `"full_attention"` / `"sliding_attention"` (Gemma, Qwen2, gpt-oss).
    #[serde(default)]
    pub layer_types: Option<serde_json::Value>,
    /// YOCO cross-layer KV sharing: the last S layers reuse an earlier layer's K/V
    /// (transformers' spelling for Gemma 3n).
    #[serde(default)]
    pub num_kv_shared_layers: Option<serde_json::Value>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Gemma: the activation (`gelu_pytorch_tanh`).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// Gemma: scores are scaled by `query_pre_attn_scalar^-1/2` (default: `head_dim`'s).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3: RoPE base of the sliding-window layers (default 10000).
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3 (older configs): every `sliding_window_pattern`-th layer is global.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3: every logit becomes `cap · tanh(logit / cap)` after the LM head (a finite
    /// cap > 0; other architectures ignore the key, as transformers does).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 2's soft-capping of the attention scores: refused for gemma3.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Set by the GGUF loader (the file's keys, not a `config.json`).
    #[serde(skip)]
    pub from_gguf: bool,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// Architectures whose forward pass is the Llama one.
const SUPPORTED_ARCHS: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
];

/// Supported `model_type` values (transformers builds the model class from it).
const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3_text"];

impl HfConfig {
    /// Reads and parses `config.json` (or any JSON text with the same fields).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::config(path, format!("not valid JSON: {e}")))
    }

    /// Validates into a [`Config`]; `path` names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<Config> {
        self.to_config().map_err(|msg| Error::config(path, msg))
    }

    /// [`validate`](Self::validate), with the error as a bare message. One step per group
    /// of fields, in this order (the first problem found is the one reported).
    fn to_config(&self) -> std::result::Result<Config, String> {
        self.check_supported()?;
        let sizes = self.sizes()?;
        let (rope_theta, rope_scaling) = self.rope()?;
        let rms_norm_eps = self.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
            return Err(format!("rms_norm_eps must be >= 0, got {rms_norm_eps}"));
        }
        let max_position_embeddings = self.max_position_embeddings.unwrap_or(2048);
        if max_position_embeddings == 0 {
            return Err("'max_position_embeddings' (the context length) must be > 0".into());
        }
        let (mut sliding_window, mut layer_types, num_kv_shared_layers) =
            self.layer_layout(sizes.n_layers)?;
        let mut gemma = GemmaOptions::default();
        if self.is_gemma3() {
            (gemma, layer_types) = self.gemma3(&sizes, layer_types, sliding_window)?;
            sliding_window = None;
        }
        let (bos_token_id, eos_token_ids) = self.token_ids(sizes.vocab_size)?;
        let cfg = Config {
            vocab_size: sizes.vocab_size,
            hidden_size: sizes.hidden_size,
            n_layers: sizes.n_layers,
            n_heads: sizes.n_heads,
            n_kv_heads: sizes.n_kv_heads,
            head_dim: sizes.head_dim,
            intermediate_size: sizes.intermediate_size,
            rms_norm_eps: rms_norm_eps as f32,
            rope_theta: rope_theta as f32,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            sliding_window,
            layer_types,
            num_kv_shared_layers,
            attention_bias: self
                .attention_bias
                .unwrap_or(self.is_arch("qwen2", "Qwen2ForCausalLM")),
            qk_norm: self.is_arch("qwen3", "Qwen3ForCausalLM") || self.is_gemma3(),
            gemma,
            bos_token_id,
            eos_token_ids,
        };
        let n_layers = cfg.n_layers;
        if let Some(l) = (cfg.layers_with_kv()..n_layers).find(|&l| cfg.kv_source(l).is_none()) {
            return Err(format!(
                "layer {l} shares K/V (num_kv_shared_layers = {}) but no layer below {} is a {} layer to share from",
                cfg.num_kv_shared_layers,
                cfg.layers_with_kv(),
                cfg.attention_type(l).name()
            ));
        }
        Ok(cfg)
    }

    /// Architecture, model type, activation and MLP bias are ones the engine implements.
    fn check_supported(&self) -> std::result::Result<(), String> {
        if let Some(archs) = &self.architectures {
            if !archs.iter().any(|a| SUPPORTED_ARCHS.contains(&a.as_str())) {
                return Err(format!(
                    "unsupported architecture {archs:?} (supported: {})",
                    SUPPORTED_ARCHS.join(", ")
                ));
            }
        }
        // transformers builds the model class from model_type, so it must agree too.
        if let Some(mt) = &self.model_type {
            if !SUPPORTED_MODEL_TYPES.contains(&mt.as_str()) {
                return Err(format!(
                    "unsupported model_type '{mt}' (supported: {})",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ));
            }
        }
        if self.is_gemma3() {
            for (key, act) in [
                ("hidden_activation", &self.hidden_activation),
                ("hidden_act", &self.hidden_act),
            ] {
                if let Some(act) = act.as_deref().filter(|a| *a != "gelu_pytorch_tanh") {
                    return Err(format!(
                        "unsupported {key} '{act}' for gemma3 (only gelu_pytorch_tanh)"
                    ));
                }
            }
            // Capping the attention scores would touch every attention kernel; Gemma 3
            // never sets it (Gemma 2 did).
            if let Some(v) = self.attn_logit_softcapping {
                return Err(format!(
                    "attn_logit_softcapping = {v} is not supported (attention score soft-capping)"
                ));
            }
        } else if let Some(act) = &self.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(format!("unsupported hidden_act '{act}' (only silu)"));
            }
        }
        if self.mlp_bias == Some(true) {
            return Err("mlp_bias = true is not supported".into());
        }
        Ok(())
    }

    fn is_gemma3(&self) -> bool {
        self.is_arch("gemma3_text", "Gemma3ForCausalLM")
    }

    /// Gemma 3's options and per-layer attention types (every `sliding_window_pattern`-th
    /// layer global, the others sliding, when the config has no `layer_types`).
    fn gemma3(
        &self,
        sizes: &Sizes,
        layer_types: Vec<AttentionType>,
        mistral_window: Option<usize>,
    ) -> std::result::Result<(GemmaOptions, Vec<AttentionType>), String> {
        let query_pre_attn_scalar = match self.query_pre_attn_scalar {
            Some(s) if !(s.is_finite() && s > 0.0) => {
                return Err(format!("query_pre_attn_scalar must be positive, got {s}"));
            }
            Some(s) if s == sizes.head_dim as f64 => None,
            s => s.map(|s| s as f32),
        };
        let final_logit_softcapping = match self.final_logit_softcapping {
            // As f32 too: the cap is applied in f32.
            Some(c) if !((c as f32).is_finite() && c as f32 > 0.0) => {
                return Err(format!(
                    "final_logit_softcapping must be a finite number > 0, got {c}"
                ));
            }
            c => c.map(|c| c as f32),
        };
        let types = if layer_types.is_empty() {
            let pattern = self.sliding_window_pattern.unwrap_or(6);
            let window = mistral_window
                .ok_or("gemma3 needs 'sliding_window' (its sliding layers' window)".to_string())?;
            if pattern == 0 {
                return Err("'sliding_window_pattern' must be > 0".into());
            }
            (0..sizes.n_layers)
                .map(|l| match (l + 1) % pattern {
                    0 => AttentionType::Full,
                    _ => AttentionType::Sliding { window },
                })
                .collect()
        } else {
            layer_types
        };
        let per_type = self
            .rope_parameters
            .as_ref()
            .and_then(|o| o.get("sliding_attention"));
        if let Some(kind) = per_type
            .and_then(|o| o.get("rope_type"))
            .and_then(|t| t.as_str())
            .filter(|t| *t != "default")
        {
            return Err(format!(
                "rope_parameters.sliding_attention.rope_type '{kind}' is not supported (only default)"
            ));
        }
        let local = per_type
            .and_then(|o| o.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .or(self.rope_local_base_freq)
            .unwrap_or(10000.0);
        if !(local.is_finite() && local > 0.0) {
            return Err(format!(
                "rope_local_base_freq must be positive, got {local}"
            ));
        }
        Ok((
            GemmaOptions {
                embed_scale: Some((sizes.hidden_size as f32).sqrt()),
                sandwich_norms: true,
                gelu_tanh: true,
                rope_local_theta: Some(local as f32),
                norm_offset: 1.0,
                query_pre_attn_scalar,
                final_logit_softcapping,
            },
            types,
        ))
    }

    /// The config names this model type or architecture class.
    fn is_arch(&self, model_type: &str, class: &str) -> bool {
        self.model_type.as_deref() == Some(model_type)
            || self
                .architectures
                .as_ref()
                .is_some_and(|a| a.iter().any(|x| x == class))
    }

    /// The model's sizes: present, positive, within bounds, and consistent (heads divide
    /// evenly, head_dim even for RoPE).
    fn sizes(&self) -> std::result::Result<Sizes, String> {
        let req = |v: Option<usize>, name: &str| -> std::result::Result<usize, String> {
            match v {
                Some(0) => Err(format!("'{name}' must be > 0")),
                Some(x) => Ok(x),
                None => Err(format!("missing '{name}'")),
            }
        };
        // Bounds far above any real model keep every derived size (q_dim, vocab x hidden,
        // ...) from overflowing and turn absurd values into an error, not an allocation.
        for (v, name, max) in [
            (self.vocab_size, "vocab_size", 1 << 24),
            (self.hidden_size, "hidden_size", 1 << 20),
            (self.num_hidden_layers, "num_hidden_layers", 1 << 12),
            (self.num_attention_heads, "num_attention_heads", 1 << 12),
            (self.num_key_value_heads, "num_key_value_heads", 1 << 12),
            (self.head_dim, "head_dim", 1 << 14),
            (self.intermediate_size, "intermediate_size", 1 << 22),
            (
                self.max_position_embeddings,
                "max_position_embeddings",
                1 << 30,
            ),
        ] {
            if let Some(x) = v.filter(|&x| x > max) {
                return Err(format!(
                    "'{name}' = {x} is larger than any supported model (at most {max})"
                ));
            }
        }
        let vocab_size = req(self.vocab_size, "vocab_size")?;
        let hidden_size = req(self.hidden_size, "hidden_size")?;
        let n_layers = req(self.num_hidden_layers, "num_hidden_layers")?;
        let n_heads = req(self.num_attention_heads, "num_attention_heads")?;
        let n_kv_heads = req(
            self.num_key_value_heads.or(Some(n_heads)),
            "num_key_value_heads",
        )?;
        let intermediate_size = req(self.intermediate_size, "intermediate_size")?;
        if n_heads % n_kv_heads != 0 {
            return Err(format!(
                "num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv_heads})"
            ));
        }
        let head_dim = match self.head_dim {
            Some(0) => return Err("'head_dim' must be > 0".into()),
            Some(h) => h,
            None => {
                if hidden_size % n_heads != 0 {
                    return Err(format!(
                        "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({n_heads})"
                    ));
                }
                hidden_size / n_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(format!("head_dim ({head_dim}) must be even for RoPE"));
        }
        Ok(Sizes {
            vocab_size,
            hidden_size,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate_size,
        })
    }

    /// `rope_theta` and the scaling, from the top level or from `rope_scaling` /
    /// `rope_parameters`.
    fn rope(&self) -> std::result::Result<(f64, RopeScaling), String> {
        // As transformers (`rope_parameters = rope_scaling or rope_parameters`): a non-empty
        // `rope_scaling` wins over `rope_parameters`.
        fn non_empty(v: &Option<serde_json::Value>) -> Option<&serde_json::Value> {
            v.as_ref().filter(|v| match v {
                serde_json::Value::Null => false,
                serde_json::Value::Object(o) => !o.is_empty(),
                _ => true,
            })
        }
        let mut rope_obj = non_empty(&self.rope_scaling).or(non_empty(&self.rope_parameters));
        // Gemma 3 (transformers 5): one entry per layer type; the global layers' entry is
        // the model's RoPE (the sliding layers' theta is read by `gemma3`).
        if let Some(full) = rope_obj.and_then(|o| o.get("full_attention")) {
            rope_obj = Some(full);
        }
        let nested_theta = rope_obj
            .and_then(|o| o.get("rope_theta"))
            .and_then(|v| v.as_f64());
        if let (Some(top), Some(nested)) = (self.rope_theta, nested_theta) {
            if top != nested {
                return Err(format!(
                    "rope_theta ({top}) and the rope_theta inside rope_parameters/rope_scaling ({nested}) disagree"
                ));
            }
        }
        let rope_theta = self.rope_theta.or(nested_theta).unwrap_or(10000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(format!("rope_theta must be positive, got {rope_theta}"));
        }
        Ok((rope_theta, parse_rope_scaling(rope_obj)?))
    }

    /// (Mistral mask window, per-layer attention types, YOCO shared layers).
    #[allow(clippy::type_complexity)]
    fn layer_layout(
        &self,
        n_layers: usize,
    ) -> std::result::Result<(Option<usize>, Vec<AttentionType>, usize), String> {
        let sliding_window = match (&self.sliding_window, self.use_sliding_window) {
            (_, Some(false)) => None,
            (Some(serde_json::Value::Number(n)), _) => {
                n.as_u64().map(|x| x as usize).filter(|&x| x > 0)
            }
            _ => None,
        };
        let (sliding_window, layer_types) = parse_layer_types(
            self.layer_types.as_ref(),
            &self.sliding_window,
            sliding_window,
            n_layers,
        )?;
        let num_kv_shared_layers = match &self.num_kv_shared_layers {
            None | Some(serde_json::Value::Null) => 0,
            Some(v) => match v.as_u64() {
                Some(s) if (s as u128) < n_layers as u128 => s as usize,
                _ => {
                    return Err(format!(
                        "'num_kv_shared_layers' must be an integer with 0 <= S < num_hidden_layers ({n_layers}), got {v}"
                    ))
                }
            },
        };
        Ok((sliding_window, layer_types, num_kv_shared_layers))
    }

    /// BOS and EOS ids, each inside the vocabulary.
    fn token_ids(&self, vocab_size: usize) -> std::result::Result<(Option<u32>, Vec<u32>), String> {
        let eos_token_ids = self
            .eos_token_id
            .as_ref()
            .map(|t| t.to_vec())
            .unwrap_or_default();
        let bos_token_id = self
            .bos_token_id
            .as_ref()
            .and_then(|t| t.to_vec().first().copied());
        for (key, id) in bos_token_id
            .map(|b| ("bos_token_id", b))
            .into_iter()
            .chain(eos_token_ids.iter().map(|&e| ("eos_token_id", e)))
        {
            if id as usize >= vocab_size {
                return Err(format!(
                    "{key} {id} is outside the vocabulary (vocab_size {vocab_size})"
                ));
            }
        }
        Ok((bos_token_id, eos_token_ids))
    }
}

/// The size fields of a config, checked ([`HfConfig::sizes`]).
struct Sizes {
    vocab_size: usize,
    hidden_size: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    intermediate_size: usize,
}

/// `layer_types` (+ `sliding_window`) → (Mistral mask window, per-layer types).
///
/// Without `layer_types` the Mistral `sliding_window` (already parsed into `mistral`) masks
/// every layer. With it, the mask is dropped and each `"sliding_attention"` layer gets the
/// window instead, which must then be a positive integer.
fn parse_layer_types(
    types: Option<&serde_json::Value>,
    window: &Option<serde_json::Value>,
    mistral: Option<usize>,
    n_layers: usize,
) -> std::result::Result<(Option<usize>, Vec<AttentionType>), String> {
    let list = match types {
        None | Some(serde_json::Value::Null) => return Ok((mistral, Vec::new())),
        Some(serde_json::Value::Array(a)) => a,
        Some(other) => {
            return Err(format!(
                "'layer_types' must be a list of strings, got {other}"
            ))
        }
    };
    if list.len() != n_layers {
        return Err(format!(
            "'layer_types' has {} entries but num_hidden_layers is {n_layers}",
            list.len()
        ));
    }
    let mut out = Vec::with_capacity(n_layers);
    for (l, t) in list.iter().enumerate() {
        out.push(match t.as_str() {
            Some("full_attention") => AttentionType::Full,
            Some("sliding_attention") => {
                let w = window
                    .as_ref()
                    .and_then(|w| w.as_u64())
                    .and_then(|w| usize::try_from(w).ok())
                    .filter(|&w| w > 0 && w <= MAX_SLIDING_WINDOW);
                let Some(window) = w else {
                    return Err(format!(
                        "layer_types[{l}] is \"sliding_attention\" but 'sliding_window' is {} (need an integer in 1..={MAX_SLIDING_WINDOW})",
                        window.as_ref().map_or("missing".to_string(), |v| v.to_string())
                    ));
                };
                AttentionType::Sliding { window }
            }
            _ => {
                return Err(format!(
                    "layer_types[{l}] = {t} (expected \"full_attention\" or \"sliding_attention\")"
                ))
            }
        });
    }
    Ok((None, out))
}

/// Largest accepted `sliding_window` of a `sliding_attention` layer (the layer's cache
/// holds this many rows).
pub const MAX_SLIDING_WINDOW: usize = 1 << 26;

fn parse_rope_scaling(v: Option<&serde_json::Value>) -> std::result::Result<RopeScaling, String> {
    let Some(obj) = v.and_then(|v| v.as_object()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str| obj.get(k).and_then(|x| x.as_f64());
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => {
            let factor = num("factor").ok_or("rope_scaling 'linear' needs 'factor'")?;
            Ok(RopeScaling::Linear {
                factor: factor as f32,
            })
        }
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor").ok_or("rope_scaling 'llama3' needs 'factor'")? as f32,
            low_freq_factor: num("low_freq_factor").unwrap_or(1.0) as f32,
            high_freq_factor: num("high_freq_factor").unwrap_or(4.0) as f32,
            original_max_position_embeddings: num("original_max_position_embeddings")
                .unwrap_or(8192.0) as usize,
        }),
        other => Err(format!("unsupported rope_scaling type '{other}'")),
    }
}
