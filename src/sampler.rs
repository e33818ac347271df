//! Next-token choice: greedy (`temperature == 0`), or temperature + top-k + top-p sampling
//! with a seeded ChaCha RNG (same seed ⇒ same tokens, on every platform).

use crate::error::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling settings (`--temperature`, `--top-k`, `--top-p`, `--seed`).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 means greedy.
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
        if self.cfg.temperature == 0.0 {
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
