//! The engine's RoPE frequencies: one inverse frequency per rotated pair of a head, with the
//! model's long-context scaling applied.
//!
//! The numerics (docs/design.md, RoPE): pair `i` of a `d`-wide head rotates at
//! `θ^(−2i/d)`, computed as transformers computes it in f32 — the exponent `2i/d` rounded to
//! f32, `θ.powf(exponent)` in f32, then `1 / that`. Scaling then rewrites each frequency on
//! its own:
//!
//! - linear (position interpolation): `f / factor`;
//! - Llama 3: with wavelength `λ = 2π / f` and the original context `L`, frequencies with
//!   `λ < L / high_freq_factor` are kept, those with `λ > L / low_freq_factor` are divided by
//!   `factor`, and those in between are blended:
//!   `s = (L/λ − low) / (high − low)`, `f ← (1 − s)·f/factor + s·f`.
//!
//! The scalar reference computes the same values (`tinygpt_reference::rope::inv_freq`);
//! the tests below check that the two agree bit for bit.

use crate::config::{Config, RopeScaling};

/// RoPE inverse frequencies for `cfg`: `head_dim / 2` values, scaling applied.
pub fn inv_freq(cfg: &Config) -> Vec<f32> {
    let d = cfg.head_dim;
    let scale = Scale::new(&cfg.rope_scaling);
    (0..d / 2)
        .map(|i| scale.apply(base_inv_freq(cfg.rope_theta, i, d)))
        .collect()
}

/// `1 / θ^(2i/d)` in f32, unscaled.
fn base_inv_freq(theta: f32, i: usize, d: usize) -> f32 {
    let exponent = (2 * i) as f32 / d as f32;
    1.0 / theta.powf(exponent)
}

/// A scaling rule with its constants precomputed.
enum Scale {
    None,
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low: f32,
        high: f32,
        /// Original context length `L`.
        ctx: f32,
        /// Wavelengths above this are divided by `factor` (`L / low_freq_factor`).
        long_wavelen: f32,
        /// Wavelengths below this are kept (`L / high_freq_factor`).
        short_wavelen: f32,
    },
}

impl Scale {
    fn new(s: &RopeScaling) -> Scale {
        match *s {
            RopeScaling::None => Scale::None,
            RopeScaling::Linear { factor } => Scale::Linear { factor },
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let ctx = original_max_position_embeddings as f32;
                Scale::Llama3 {
                    factor,
                    low: low_freq_factor,
                    high: high_freq_factor,
                    ctx,
                    long_wavelen: ctx / low_freq_factor,
                    short_wavelen: ctx / high_freq_factor,
                }
            }
        }
    }

    fn apply(&self, f: f32) -> f32 {
        match *self {
            Scale::None => f,
            Scale::Linear { factor } => f / factor,
            Scale::Llama3 {
                factor,
                low,
                high,
                ctx,
                long_wavelen,
                short_wavelen,
            } => {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen < short_wavelen {
                    f
                } else if wavelen > long_wavelen {
                    f / factor
                } else {
                    let s = (ctx / wavelen - low) / (high - low);
                    (1.0 - s) * f / factor + s * f
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(theta: f32, head_dim: usize, rope_scaling: RopeScaling) -> Config {
        Config {
            vocab_size: 8,
            hidden_size: head_dim * 2,
            n_layers: 1,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim,
            intermediate_size: 8,
            rms_norm_eps: 1e-5,
            rope_theta: theta,
            rope_scaling,
            max_position_embeddings: 131072,
            tie_word_embeddings: true,
            sliding_window: None,
            layer_types: Vec::new(),
            num_kv_shared_layers: 0,
            attention_bias: false,
            qk_norm: false,
            gemma: Default::default(),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }

    fn scalings() -> Vec<RopeScaling> {
        vec![
            RopeScaling::None,
            RopeScaling::Linear { factor: 2.0 },
            RopeScaling::Linear { factor: 8.0 },
            // Llama 3.1 / 3.2 constants.
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            // A small original context puts many frequencies in the blended band.
            RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 2.0,
                high_freq_factor: 8.0,
                original_max_position_embeddings: 256,
            },
        ]
    }

    #[test]
    fn equals_the_reference_bit_for_bit() {
        let mut checked = 0;
        for theta in [10_000.0f32, 100_000.0, 500_000.0, 1_000_000.0] {
            for head_dim in [32usize, 64, 128] {
                for s in scalings() {
                    let c = cfg(theta, head_dim, s);
                    let ours = inv_freq(&c);
                    let theirs = tinygpt_reference::rope::inv_freq(&c);
                    assert_eq!(ours.len(), head_dim / 2);
                    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "theta {theta} head_dim {head_dim} {:?} pair {i}: {a} vs {b}",
                            c.rope_scaling
                        );
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 4 * 3 * 6);
    }

    #[test]
    fn llama3_bands_are_all_exercised() {
        // Guards the test above: with these constants some frequencies are kept, some
        // divided and some blended, so each branch of `Scale::apply` is compared.
        let c = cfg(500_000.0, 128, scalings()[3].clone());
        let plain = inv_freq(&cfg(500_000.0, 128, RopeScaling::None));
        let scaled = inv_freq(&c);
        let kept = plain.iter().zip(&scaled).filter(|(a, b)| a == b).count();
        let divided = plain
            .iter()
            .zip(&scaled)
            .filter(|(a, b)| **b == **a / 8.0)
            .count();
        let blended = plain.len() - kept - divided;
        assert!(
            kept > 0 && divided > 0 && blended > 0,
            "{kept} {divided} {blended}"
        );
    }

    #[test]
    fn known_values() {
        // θ = 10000, d = 4: pair 0 → 1, pair 1 → 1/100 (independent of either implementation).
        let f = inv_freq(&cfg(10_000.0, 4, RopeScaling::None));
        assert_eq!(f, vec![1.0, 0.01]);
        let f = inv_freq(&cfg(10_000.0, 4, RopeScaling::Linear { factor: 4.0 }));
        assert_eq!(f, vec![0.25, 0.0025]);
    }
}
