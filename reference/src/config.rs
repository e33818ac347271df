//! The validated model configuration shared by the reference and the engine.
//!
//! This is the second stage of the two-stage config (DESIGN.md §6): file formats
//! (Hugging Face `config.json`, GGUF metadata, `.tinygpt`) are parsed by the engine
//! into their own mirror structs and converted into this one, with every derived
//! size computed once here.

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
    /// Mistral's sliding attention window (tokens), if the model has one.
    pub sliding_window: Option<usize>,
    /// Qwen2-style biases on the q/k/v projections.
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl Config {
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

    /// RoPE inverse frequencies, one per rotated pair (`head_dim / 2` values),
    /// with the model's scaling applied. Computed in f64 and rounded once, as
    /// transformers computes them in f32 from `theta ** (2i/d)`.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let mut out = Vec::with_capacity(d / 2);
        for i in 0..d / 2 {
            // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim))
            let exponent = (2 * i) as f32 / d as f32;
            let inv = 1.0f32 / self.rope_theta.powf(exponent);
            out.push(inv);
        }
        match &self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                for f in &mut out {
                    *f /= *factor;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_ctx = *original_max_position_embeddings as f32;
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                for f in &mut out {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen < high_freq_wavelen {
                        // high frequency: unchanged
                    } else if wavelen > low_freq_wavelen {
                        *f /= factor;
                    } else {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        out
    }
}
