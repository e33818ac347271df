//! Rotary position embedding, Hugging Face "rotate_half" convention.
//!
//! A head vector `x` of width `d` is split into halves `x[..d/2]` and `x[d/2..]`;
//! pair `i` is `(x[i], x[i + d/2])` and is rotated by the angle `pos · inv_freq[i]`.
//! The angle is computed in f32 exactly as transformers does (`pos as f32 * inv_freq`),
//! so that long positions round the same way in both implementations.

use crate::config::Config;

/// Per-model RoPE constants.
#[derive(Debug, Clone)]
pub struct Rope {
    /// One inverse frequency per rotated pair: `head_dim / 2` values.
    pub inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &Config) -> Self {
        Rope {
            inv_freq: cfg.rope_inv_freq(),
        }
    }

    /// Rotates one head vector in place to position `pos`.
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        debug_assert_eq!(x.len(), 2 * half);
        for i in 0..half {
            let angle = pos as f32 * self.inv_freq[i];
            let (sin, cos) = (angle.sin(), angle.cos());
            let x1 = x[i];
            let x2 = x[i + half];
            x[i] = x1 * cos - x2 * sin;
            x[i + half] = x2 * cos + x1 * sin;
        }
    }

    /// Rotates every head of a concatenated `(heads, head_dim)` vector to `pos`.
    pub fn rotate_heads(&self, x: &mut [f32], pos: usize) {
        let d = 2 * self.inv_freq.len();
        for head in x.chunks_mut(d) {
            self.rotate(head, pos);
        }
    }
}
