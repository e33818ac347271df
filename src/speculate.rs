//! Speculative decoding with prompt-lookup drafts (`--speculate ngram[:K]`,
//! docs/design.md §3.3).
//!
//! A decode step normally reads every weight to produce one token. Here, when the text so
//! far repeats (the last few tokens occurred before, in the prompt or the output), the
//! tokens that followed that earlier occurrence are proposed as a *draft* of up to `K`
//! tokens; one multi-token forward pass over `[last, d1, …, dk]` (the batched products
//! read each weight once for all of them) gives the logits at all `k + 1` positions, and
//! the drafts are checked against them in order. [`Generation`](crate::generate::Generation)
//! runs the pass between a cache [`hold`](crate::kv_cache::KvCache::hold) and a
//! [`release`](crate::kv_cache::KvCache::release) that keeps exactly the rows plain decoding
//! would have appended (§3.2), so eviction, KIVI groups and every later step see the same
//! cache as without drafts.
//!
//! * **Greedy**: a draft token is accepted while it equals the argmax of the logits before
//!   it; the first mismatch's argmax (or, all accepted, the argmax after the last draft) is
//!   emitted too. The ids and every emitted position's logits are those of plain decoding,
//!   bit for bit: the multi-token forward equals the token-by-token one.
//! * **Sampling**: standard speculative sampling with a deterministic drafter (the draft
//!   distribution is a point mass): draft token `d` is accepted with probability `p(d)`
//!   under the sampler's distribution (temperature, top-k, top-p); on rejection a token is
//!   drawn from `p` without `d`, renormalised. The output distribution is the sampler's;
//!   the random stream differs, so a seed reproduces a speculative run, not a plain one.
//! * **When drafts do not pay**, drafting stops by itself ([`Speculator::draft_len`]): the
//!   draft length maximises the expected tokens per pass against the pass's cost, from a
//!   running estimate of the acceptance rate; when even one draft token does not pay,
//!   plain steps run, with a probe after a back-off that doubles while probes fail. The
//!   choice depends only on accept counts (never on timing), so runs are reproducible.

use crate::error::{Error, Result};
use crate::generate::check_finite;
use crate::sampler::Sampler;
use std::collections::VecDeque;

/// `--speculate` default draft length.
pub const DEFAULT_DRAFT: usize = 8;
/// Largest accepted draft length.
pub const MAX_DRAFT: usize = 64;
/// Longest and shortest n-gram looked up.
const MAX_NGRAM: usize = 4;
const MIN_NGRAM: usize = 2;
/// Cost of each drafted token in a verification pass, in single-token steps: a pass of
/// `k + 1` tokens costs about `1 + COST_PER_DRAFT · k` steps (the weights are read once; each
/// extra token adds its integer dot products, attention and a row of the LM head).
/// `cargo bench --bench speculate` on a 2-core AVX2 host, 1 thread: SmolLM2 Q4_1 ≈ 0.25–0.33,
/// Gemma 3 270M Q4_K_M ≈ 0.5 (its 262,144-row head is computed per token). One constant,
/// not a timing, keeps the draft lengths, and so a seeded sampled run, reproducible.
const COST_PER_DRAFT: f64 = 0.3;
/// Weight of the newest pass in the acceptance-rate estimate.
const ALPHA_WEIGHT: f64 = 0.25;
/// Plain steps before the first probe once drafting stopped paying; doubles per failed
/// probe up to [`MAX_BACKOFF`].
const MIN_BACKOFF: usize = 8;
const MAX_BACKOFF: usize = 256;

/// What `--speculate` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// Longest draft (`K`).
    pub max_draft: usize,
}

impl SpecConfig {
    /// Parses `ngram` or `ngram:K` (`K` in 1..=[`MAX_DRAFT`]); errors name `flag`.
    pub fn parse(s: &str, flag: &str) -> Result<SpecConfig> {
        let bad = |why: String| Error::flag(flag, why);
        let (kind, k) = match s.split_once(':') {
            Some((kind, k)) => (kind, Some(k)),
            None => (s, None),
        };
        if kind != "ngram" {
            return Err(bad(format!(
                "expected `ngram` or `ngram:K` (K = longest draft, 1..={MAX_DRAFT}), got `{s}`"
            )));
        }
        let max_draft = match k {
            None => DEFAULT_DRAFT,
            Some(k) => match k.parse::<usize>() {
                Ok(k) if (1..=MAX_DRAFT).contains(&k) => k,
                _ => {
                    return Err(bad(format!(
                        "the draft length K in `ngram:K` must be 1..={MAX_DRAFT}, got `{k}`"
                    )))
                }
            },
        };
        Ok(SpecConfig { max_draft })
    }
}

/// Counts of a speculative run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Draft tokens proposed (and verified).
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Verification passes (multi-token forwards).
    pub passes: usize,
    /// Decode forward passes of any kind (plain steps and verification passes).
    pub forwards: usize,
    /// Tokens those passes produced.
    pub produced: usize,
}

impl SpecStats {
    /// Tokens per decode forward pass (1 without accepted drafts, and without passes).
    pub fn tokens_per_step(&self) -> f64 {
        match self.forwards {
            0 => 1.0,
            n => self.produced as f64 / n as f64,
        }
    }
}

/// The draft continuation of `context`: for the longest n-gram suffix (`MAX_NGRAM` down
/// to `MIN_NGRAM` tokens) that occurred earlier, the up to `k` tokens that followed its
/// most recent earlier occurrence. Empty when nothing repeats.
pub fn lookup(context: &[u32], k: usize) -> &[u32] {
    let len = context.len();
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let pattern = &context[len - n..];
        // Earlier occurrences start at i < len - n; the most recent one first.
        for i in (0..len - n).rev() {
            if &context[i..i + n] == pattern {
                let from = i + n;
                return &context[from..(from + k).min(len)];
            }
        }
    }
    &[]
}

/// A generation's drafting state: the text so far (prompt and output ids), tokens
/// already verified and waiting to be emitted, the acceptance estimate and the counts.
#[derive(Debug, Clone)]
pub(crate) struct Speculator {
    cfg: SpecConfig,
    /// Prompt and emitted ids.
    pub(crate) context: Vec<u32>,
    /// Verified tokens not emitted yet (their rows are in the cache as plain decoding
    /// would have them, the last one's excepted: it is fed by the next step).
    pub(crate) queue: VecDeque<u32>,
    /// Running estimate of the probability that a draft token is accepted.
    alpha: f64,
    /// Plain steps left before drafting is tried again, and the back-off that set it.
    wait: usize,
    backoff: usize,
    pub(crate) stats: SpecStats,
}

impl Speculator {
    pub(crate) fn new(cfg: SpecConfig, prompt: &[u32]) -> Speculator {
        Speculator {
            cfg,
            context: prompt.to_vec(),
            queue: VecDeque::new(),
            alpha: 0.5,
            wait: 0,
            backoff: MIN_BACKOFF,
            stats: SpecStats::default(),
        }
    }

    /// How many draft tokens are worth verifying now (at most `budget`): the `k` that
    /// maximises expected tokens per pass over the pass's cost, 0 when no `k ≥ 1` beats a
    /// plain step. After a stop, 0 for `wait` steps, then a one-token probe.
    pub(crate) fn draft_len(&mut self, budget: usize) -> usize {
        let budget = budget.min(self.cfg.max_draft);
        if budget == 0 {
            return 0;
        }
        if self.wait > 0 {
            self.wait -= 1;
            return if self.wait == 0 { 1 } else { 0 };
        }
        let a = self.alpha.clamp(0.0, 0.999);
        let mut best = (1.0, 0usize);
        let mut expect = 1.0; // tokens a pass of k drafts yields: 1 + a + … + a^k
        let mut term = 1.0;
        for k in 1..=budget {
            term *= a;
            expect += term;
            let gain = expect / (1.0 + COST_PER_DRAFT * k as f64);
            if gain > best.0 {
                best = (gain, k);
            }
        }
        if best.1 == 0 {
            self.wait = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
        best.1
    }

    /// Records a verification pass that accepted `accepted` of `drafted` tokens.
    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        self.stats.drafted += drafted;
        self.stats.accepted += accepted;
        self.stats.passes += 1;
        let rate = accepted as f64 / drafted.max(1) as f64;
        self.alpha += ALPHA_WEIGHT * (rate - self.alpha);
        if accepted > 0 {
            self.backoff = MIN_BACKOFF;
        }
    }

    /// The draft for the next pass (at most `k` tokens), from the context.
    pub(crate) fn draft(&self, k: usize) -> Vec<u32> {
        lookup(&self.context, k).to_vec()
    }

    /// Records a decode forward pass that produced `n` tokens.
    pub(crate) fn forward_done(&mut self, n: usize) {
        self.stats.forwards += 1;
        self.stats.produced += n;
    }
}

/// Checks the drafts of a verification pass (docs/design.md §3.3) as plain decoding would
/// have chosen each token: `all` holds the logits after each of `[last, draft…]`,
/// `(draft.len() + 1, vocab)`, the first row at position `pos`. Draft `d_i` is accepted by
/// [`Sampler::verify`] against the row before it (greedy: while it is the argmax); the
/// first rejection's replacement, or after every draft the token sampled from the last
/// row, ends the output, which is also cut after a token for which `ends` is true (an
/// end-of-sequence token). Returns the output tokens and how many drafts were accepted.
/// One function for `sample` ([`Generation`](crate::generate::Generation)) and `serve`
/// (the scheduler), so they check a draft alike.
pub(crate) fn check(
    sampler: &mut Sampler,
    all: &[f32],
    draft: &[u32],
    pos: usize,
    ends: impl Fn(u32) -> bool,
) -> Result<(Vec<u32>, usize)> {
    let vocab = all.len() / (draft.len() + 1);
    let mut out = Vec::with_capacity(draft.len() + 1);
    let mut accepted = 0;
    for (i, row) in all.chunks_exact(vocab).enumerate() {
        check_finite(row, pos + i)?;
        let (t, ok) = match draft.get(i) {
            Some(&d) => match sampler.verify(row, d) {
                None => (d, true),
                Some(t) => (t, false),
            },
            None => (sampler.sample(row), false),
        };
        out.push(t);
        accepted += usize::from(ok);
        if !ok || ends(t) {
            break;
        }
    }
    Ok((out, accepted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_ngram_and_a_bounded_k() {
        assert_eq!(
            SpecConfig::parse("ngram", "--speculate").unwrap().max_draft,
            DEFAULT_DRAFT
        );
        assert_eq!(
            SpecConfig::parse("ngram:3", "--speculate")
                .unwrap()
                .max_draft,
            3
        );
        for bad in [
            "",
            "ngram:",
            "ngram:0",
            "ngram:65",
            "ngram:x",
            "draft",
            "ngram:3:4",
        ] {
            let e = SpecConfig::parse(bad, "--speculate")
                .unwrap_err()
                .to_string();
            assert!(e.contains("--speculate"), "{bad}: {e}");
        }
    }

    /// Against a direct search written the plain way: every suffix length, every earlier
    /// start, the latest match of the longest suffix wins.
    #[test]
    fn lookup_finds_the_latest_longest_match() {
        fn naive(c: &[u32], k: usize) -> Vec<u32> {
            for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
                if c.len() <= n {
                    continue;
                }
                let mut found = None;
                for i in 0..c.len() - n {
                    if c[i..i + n] == c[c.len() - n..] {
                        found = Some(i);
                    }
                }
                if let Some(i) = found {
                    return c[i + n..(i + n + k).min(c.len())].to_vec();
                }
            }
            Vec::new()
        }
        let mut x = 12345u64;
        for case in 0..2000 {
            let len = case % 40;
            let vocab = 2 + (case % 5) as u64;
            let c: Vec<u32> = (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % vocab) as u32
                })
                .collect();
            for k in [1, 3, 8] {
                assert_eq!(lookup(&c, k), &naive(&c, k)[..], "{c:?} k={k}");
            }
        }
        assert_eq!(lookup(&[1, 2, 3, 9, 1, 2, 3], 2), &[9, 1]);
        assert!(lookup(&[1, 2, 3, 4], 4).is_empty());
    }

    /// High acceptance drafts long; no acceptance stops drafting, then probes after a
    /// back-off that doubles while probes fail and resets when one succeeds.
    #[test]
    fn draft_length_follows_acceptance() {
        let mut s = Speculator::new(SpecConfig { max_draft: 8 }, &[]);
        for _ in 0..20 {
            s.record(8, 8);
        }
        assert!(s.draft_len(8) >= 6);
        assert_eq!(s.draft_len(2), 2, "bounded by the budget");
        for _ in 0..20 {
            s.record(4, 0);
        }
        let mut gaps = Vec::new();
        let mut since = 0;
        for _ in 0..200 {
            since += 1;
            if s.draft_len(8) > 0 {
                gaps.push(since);
                since = 0;
                s.record(1, 0);
            }
        }
        assert!(gaps.len() >= 3, "{gaps:?}");
        assert!(
            gaps.windows(2).all(|w| w[1] >= w[0]),
            "back-off grows: {gaps:?}"
        );
        assert!(gaps[0] > MIN_BACKOFF / 2, "{gaps:?}");
    }
}
