//! The validated model configuration shared by the reference and the engine.
//!
//! This is the second stage of the two-stage config (docs/design.md §6): file formats
//! (Hugging Face `config.json`, GGUF metadata, `.tinygpt`) are parsed by the engine
//! into their own mirror structs and checked into this one (`HfConfig::validate` in the
//! engine's `src/config.rs`), with every derived size computed once here. The RoPE
//! frequencies are numerics: each crate computes its own (`tinygpt_reference::rope::inv_freq`,
//! the engine's `rope.rs`).

use crate::kv::KvConfig;

/// How RoPE frequencies are rescaled for long contexts (`rope_scaling` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// Attention type of one layer (transformers' `layer_types` entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionType {
    /// `"full_attention"`: sees every stored row (the StreamingLLM flags still bound it).
    Full,
    /// `"sliding_attention"`: a query at position `p` sees keys at positions `> p − window`,
    /// so the layer's cache holds only the last `window` tokens.
    Sliding { window: usize },
}

impl AttentionType {
    /// The name used in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionType::Full => "full_attention",
            AttentionType::Sliding { .. } => "sliding_attention",
        }
    }
}

/// Gemma-family options; all off (the default) for Llama, Mistral and Qwen.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GemmaOptions {
    /// The embedding row is multiplied by this (√hidden for Gemma).
    pub embed_scale: Option<f32>,
    /// An RMSNorm on the attention output and on the MLP output, each before its residual
    /// add (Gemma's `post_attention_layernorm` / `post_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// GeGLU with tanh-approximated GELU (`gelu_pytorch_tanh`) instead of SwiGLU.
    pub gelu_tanh: bool,
    /// RoPE base of the sliding-window layers (unscaled); `None`: `rope_theta` everywhere.
    pub rope_local_theta: Option<f32>,
    /// Added to every RMSNorm weight at load: Hugging Face Gemma checkpoints store `w − 1`
    /// (their norm multiplies by `1 + w`); llama.cpp's GGUF files store `w` itself (0).
    pub norm_offset: f32,
    /// Gemma's `query_pre_attn_scalar`: scores are scaled by its inverse square root instead
    /// of `head_dim`'s (`None`: `head_dim`). Only Gemma 2/3 27B set it apart from `head_dim`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Final logit soft-capping (`final_logit_softcapping`): after the LM head every logit
    /// becomes `cap · tanh(logit / cap)` in f32 (each crate's `soft_cap`); `None`: no
    /// capping.
    pub final_logit_softcapping: Option<f32>,
}

/// A validated Llama-family configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Mistral's sliding attention window (tokens), applied as a mask in every layer, if
    /// the model has one. Always `None` when `layer_types` is given (the window then lives
    /// in the sliding layers' [`AttentionType`]).
    pub sliding_window: Option<usize>,
    /// Per-layer attention types (`layer_types`); empty means every layer is full attention.
    pub layer_types: Vec<AttentionType>,
    /// YOCO cross-layer KV sharing (`num_kv_shared_layers` = S, `0 ≤ S < n_layers`): the
    /// last S layers compute no K/V and attend over the cache of the last non-shared
    /// layer of their own attention type (see [`Config::kv_source`]).
    pub num_kv_shared_layers: usize,
    /// Qwen2-style biases on the q/k/v projections.
    pub attention_bias: bool,
    /// Qwen3-style per-head RMSNorm of q and k (weights of length `head_dim`, shared by
    /// every head) after the projections and before RoPE.
    pub qk_norm: bool,
    /// Gemma-family options (see [`GemmaOptions`]).
    pub gemma: GemmaOptions,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl Config {
    /// The factor every attention score `q·k` is multiplied by before the softmax:
    /// `1 / √head_dim`, or `1 / √query_pre_attn_scalar` where the config sets it; computed
    /// in f32 (a square root, then a division, each rounded once).
    pub fn score_scale(&self) -> f32 {
        let base = self
            .gemma
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f32);
        1.0 / base.sqrt()
    }
    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// Query heads per key/value head (GQA group factor).
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Attention type of layer `l`.
    pub fn attention_type(&self, l: usize) -> AttentionType {
        self.layer_types
            .get(l)
            .copied()
            .unwrap_or(AttentionType::Full)
    }

    /// Layers that compute and store K/V: layers `0..layers_with_kv()`.
    pub fn layers_with_kv(&self) -> usize {
        self.n_layers - self.num_kv_shared_layers
    }

    /// The layer whose cache layer `l` attends over: `l` itself if it holds K/V, else the
    /// last layer below `layers_with_kv()` with the same attention type (without
    /// `layer_types`, layer `layers_with_kv() − 1`). `None` only for a shared layer whose
    /// type no K/V layer has (validation rejects such configs).
    pub fn kv_source(&self, l: usize) -> Option<usize> {
        let owners = self.layers_with_kv();
        if l < owners {
            return Some(l);
        }
        let kind = |j: usize| std::mem::discriminant(&self.attention_type(j));
        (0..owners).rev().find(|&j| kind(j) == kind(l))
    }

    /// The cache configuration of layer `l` (a layer that holds K/V) under the user's
    /// `kv`: a sliding layer keeps only its last `window` tokens (`sink` 0, `window` W:
    /// the same keys the Mistral mask `pos − key_pos < W` leaves visible), or fewer when
    /// the user's StreamingLLM budget is smaller (`min(W, sink + window)`: no layer holds
    /// more rows than the user asked for), with the user's precision, group size and
    /// positions mode; a full layer takes `kv` as is.
    pub fn layer_kv_config(&self, l: usize, kv: &KvConfig) -> KvConfig {
        match self.attention_type(l) {
            AttentionType::Full => kv.clone(),
            AttentionType::Sliding { window } => KvConfig {
                sink: 0,
                window: Some(match kv.window {
                    Some(user) => window.min(kv.sink + user),
                    None => window,
                }),
                ..kv.clone()
            },
        }
    }

    /// The configuration layer `l`'s RoPE is built from: this one, or for a sliding layer
    /// of a model with [`GemmaOptions::rope_local_theta`], a copy with that base and no
    /// scaling.
    pub fn rope_config(&self, l: usize) -> std::borrow::Cow<'_, Config> {
        match (self.attention_type(l), self.gemma.rope_local_theta) {
            (AttentionType::Sliding { .. }, Some(theta)) => std::borrow::Cow::Owned(Config {
                rope_theta: theta,
                rope_scaling: RopeScaling::None,
                ..self.clone()
            }),
            _ => std::borrow::Cow::Borrowed(self),
        }
    }
}
