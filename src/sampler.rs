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
        self.distribution(logits);
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

    /// Speculative sampling's check of a draft token `d` (proposed by a deterministic
    /// drafter) against `logits` (src/speculate.rs): `None` accepts `d`, `Some(t)` rejects it
    /// and gives the token to emit instead. Greedy: accepted when `d` is the argmax, else
    /// the argmax. Sampling: accepted with probability `p(d)` under [`sample`]'s
    /// distribution; on rejection `t` is drawn from that distribution without `d`,
    /// renormalised, so the emitted token is distributed as [`sample`]'s.
    ///
    /// [`sample`]: Self::sample
    pub fn verify(&mut self, logits: &[f32], d: u32) -> Option<u32> {
        if self.cfg.is_greedy() {
            let t = crate::ops::argmax(logits) as u32;
            return (t != d).then_some(t);
        }
        self.distribution(logits);
        let p = self.cand.iter().find(|c| c.1 == d).map_or(0.0, |c| c.0);
        if self.rng.gen::<f32>() < p {
            return None;
        }
        let rest: f32 = self.cand.iter().filter(|c| c.1 != d).map(|c| c.0).sum();
        let r = self.rng.gen::<f32>() * rest;
        let mut cum = 0.0f32;
        let mut last = None;
        for c in self.cand.iter().filter(|c| c.1 != d) {
            cum += c.0;
            last = Some(c.1);
            if r < cum {
                return Some(c.1);
            }
        }
        // Rounding left `r` at the top of the range: the last candidate; no candidate but
        // `d` (top-k 1, or top-p kept one token) cannot reject, as `p(d)` is then 1.
        Some(last.unwrap_or(d))
    }

    /// `self.cand` = the sampling distribution of `logits`: (probability, id), most
    /// likely first, after temperature, top-k and top-p, normalised.
    fn distribution(&mut self, logits: &[f32]) {
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
    /// The test's own sampling distribution, in f64: softmax of `logits / t` over the top
    /// `k` (0: all), cut to the smallest prefix holding `top_p`, renormalised.
    fn expected(logits: &[f32], t: f64, k: usize, top_p: f64) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if k > 0 {
            idx.truncate(k);
        }
        let max = logits[idx[0]] as f64 / t;
        let w: Vec<f64> = idx
            .iter()
            .map(|&i| (logits[i] as f64 / t - max).exp())
            .collect();
        let sum: f64 = w.iter().sum();
        let mut keep = idx.len();
        let mut cum = 0.0;
        for (j, x) in w.iter().enumerate() {
            cum += x / sum;
            if cum >= top_p {
                keep = j + 1;
                break;
            }
        }
        let kept: f64 = w[..keep].iter().sum();
        let mut p = vec![0.0; logits.len()];
        for (j, &i) in idx[..keep].iter().enumerate() {
            p[i] = w[j] / kept;
        }
        p
    }

    /// Speculative sampling keeps the distribution: whatever the draft (likely, unlikely,
    /// cut by top-k or top-p), the token `verify` emits (the draft when accepted, its
    /// replacement when not) is distributed as `sample`'s, within 5 standard errors over
    /// 200,000 draws; and greedy `verify` accepts exactly the argmax.
    #[test]
    fn verify_emits_the_sampler_distribution() {
        let logits = [2.0f32, 1.5, 0.3, -1.0, 0.9, -3.0, 1.1, 0.0];
        let n = 200_000;
        for (k, top_p) in [(0usize, 1.0f32), (4, 1.0), (0, 0.8)] {
            let want = expected(&logits, 0.9, k, top_p as f64);
            for d in [0u32, 2, 5] {
                let mut s = Sampler::new(SamplerConfig {
                    temperature: 0.9,
                    top_k: k,
                    top_p,
                    seed: 7 + d as u64,
                });
                let mut count = [0usize; 8];
                for _ in 0..n {
                    let t = s.verify(&logits, d).unwrap_or(d);
                    count[t as usize] += 1;
                }
                for (i, (&c, &p)) in count.iter().zip(&want).enumerate() {
                    let f = c as f64 / n as f64;
                    let se = (p * (1.0 - p) / n as f64).sqrt();
                    assert!(
                        (f - p).abs() <= 5.0 * se + 1e-4,
                        "top_k {k} top_p {top_p} draft {d}: token {i} at {f}, want {p}"
                    );
                }
            }
        }
        let mut g = Sampler::new(cfg(0.0, 1));
        assert_eq!(g.verify(&logits, 0), None);
        assert_eq!(g.verify(&logits, 1), Some(0));
    }
}
