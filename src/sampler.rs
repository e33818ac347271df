//! Next-token choice: greedy (`temperature` below [`GREEDY_BELOW`], 0 included), or
//! temperature + top-k + top-p sampling with a seeded ChaCha RNG (same seed ⇒ same
//! tokens, on every platform).

use crate::error::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Temperatures below this are greedy (as vLLM treats them): dividing logits by a
/// smaller temperature overflows f32 (1e-40 makes every logit ±inf and the softmax NaN),
/// and the distribution is already one-hot to f32 precision long before.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Sampling settings (`--temperature`, `--top-k`, `--top-p`, `--seed`).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 (or anything below [`GREEDY_BELOW`]) means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Whether [`Sampler::sample`] takes the argmax (temperature below [`GREEDY_BELOW`]).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// Checks ranges; errors name the flag.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::flag(
                "--temperature",
                format!("must be >= 0, got {}", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::flag(
                "--top-p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    /// (probability, id) scratch.
    cand: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            cfg,
            cand: Vec::new(),
        }
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.is_greedy() {
            return crate::ops::argmax(logits) as u32;
        }
        let t = self.cfg.temperature;
        self.cand.clear();
        self.cand
            .extend(logits.iter().enumerate().map(|(i, &l)| (l / t, i as u32)));
        // Highest first; ties broken by lower id so the order is total and deterministic.
        let by_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = if self.cfg.top_k > 0 {
            self.cfg.top_k.min(self.cand.len())
        } else {
            self.cand.len()
        };
        if k < self.cand.len() {
            self.cand.select_nth_unstable_by(k - 1, by_desc);
            self.cand.truncate(k);
        }
        self.cand.sort_unstable_by(by_desc);
        let max = self.cand[0].0;
        let mut sum = 0.0f32;
        for c in self.cand.iter_mut() {
            c.0 = (c.0 - max).exp();
            sum += c.0;
        }
        for c in self.cand.iter_mut() {
            c.0 /= sum;
        }
        if self.cfg.top_p < 1.0 {
            let mut cum = 0.0f32;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                cum += c.0;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
            let s: f32 = self.cand.iter().map(|c| c.0).sum();
            for c in self.cand.iter_mut() {
                c.0 /= s;
            }
        }
        let r: f32 = self.rng.gen::<f32>();
        let mut cum = 0.0f32;
        for c in &self.cand {
            cum += c.0;
            if r < cum {
                return c.1;
            }
        }
        self.cand.last().map(|c| c.1).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
            seed,
        }
    }

    #[test]
    fn temperatures_below_the_floor_are_greedy() {
        // Logits whose argmax (id 3) is not the first id, with a runner-up close by.
        let logits = [1.0f32, -2.0, 0.5, 7.25, 7.0, -30.0, 40.0 - 33.0];
        for t in [0.0, 1e-45, 1e-40, 1e-20, 1e-6, GREEDY_BELOW * 0.999] {
            for seed in 0..20 {
                assert_eq!(Sampler::new(cfg(t, seed)).sample(&logits), 3, "t = {t:e}");
            }
            assert!(cfg(t, 0).is_greedy());
        }
        assert!(!cfg(GREEDY_BELOW, 0).is_greedy());
    }

    #[test]
    fn small_temperatures_above_the_floor_sample_a_real_token() {
        // Logits up to 1e4 divided by a small temperature stay finite, and the runner-ups
        // are 0.5 / t >= 500 nats behind the one maximum (id 500): every pick is it.
        let logits: Vec<f32> = (0..1000)
            .map(|i| 1e4 - (i as f32 - 500.0).abs() * 0.5)
            .collect();
        let best = crate::ops::argmax(&logits) as u32;
        for t in [GREEDY_BELOW, 1e-4, 1e-3] {
            for seed in 0..10 {
                assert_eq!(Sampler::new(cfg(t, seed)).sample(&logits), best);
            }
        }
    }
}
