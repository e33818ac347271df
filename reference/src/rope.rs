//! Rotary position embedding, Hugging Face "rotate_half" convention.
//!
//! A head vector `x` of width `d` is split into halves `lo = x[..d/2]` and `hi = x[d/2..]`;
//! pair `i` is `(lo[i], hi[i])` and is rotated by the angle `pos · inv_freq[i]`.
//! The angle is computed in f32 exactly as transformers does (`pos as f32 * inv_freq`),
//! so that long positions round the same way in both implementations.

use crate::config::{Config, RopeScaling};
use ndarray::{Array1, ArrayViewMut1, ArrayViewMut2, Axis};

/// RoPE inverse frequencies, one per rotated pair (`head_dim / 2` values),
/// with the model's scaling applied. Computed in f64 and rounded once, as
/// transformers computes them in f32 from `theta ** (2i/d)`.
pub fn inv_freq(cfg: &Config) -> Vec<f32> {
    let d = cfg.head_dim;
    let mut out = Vec::with_capacity(d / 2);
    for i in 0..d / 2 {
        // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim))
        let exponent = (2 * i) as f32 / d as f32;
        let inv = 1.0f32 / cfg.rope_theta.powf(exponent);
        out.push(inv);
    }
    match &cfg.rope_scaling {
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

/// Per-model RoPE constants.
#[derive(Debug, Clone)]
pub struct Rope {
    /// One inverse frequency per rotated pair: `(head_dim / 2)`.
    pub inv_freq: Array1<f32>,
}

impl Rope {
    pub fn new(cfg: &Config) -> Self {
        Rope {
            inv_freq: Array1::from(inv_freq(cfg)),
        }
    }

    /// Rotates one head vector, `(head_dim)`, in place to position `pos`.
    pub fn rotate(&self, x: ArrayViewMut1<f32>, pos: usize) {
        let half = self.inv_freq.len();
        assert_eq!(
            x.len(),
            2 * half,
            "a head has head_dim = 2 · inv_freq.len() values"
        );
        let (mut lo, mut hi) = x.split_at(Axis(0), half);
        for i in 0..half {
            let angle = pos as f32 * self.inv_freq[i];
            let (sin, cos) = (angle.sin(), angle.cos());
            let (x1, x2) = (lo[i], hi[i]);
            lo[i] = x1 * cos - x2 * sin;
            hi[i] = x2 * cos + x1 * sin;
        }
    }

    /// Rotates every head (row) of a `(heads, head_dim)` array to `pos`.
    pub fn rotate_rows(&self, mut heads: ArrayViewMut2<f32>, pos: usize) {
        for head in heads.rows_mut() {
            self.rotate(head, pos);
        }
    }

    /// [`rotate_rows`](Self::rotate_rows) for a flat slice of concatenated heads,
    /// `heads · head_dim` values, for callers that hold plain slices.
    pub fn rotate_heads(&self, x: &mut [f32], pos: usize) {
        let d = 2 * self.inv_freq.len();
        for head in x.chunks_mut(d) {
            self.rotate(ArrayViewMut1::from(head), pos);
        }
    }
}
