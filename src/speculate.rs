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
use crate::generate::{check_finite, Engine, EngineRun};
use crate::kv_cache::KvConfig;
use crate::model::Model;
use crate::sampler::Sampler;
use crate::weights::ModelFiles;
use std::collections::VecDeque;
use std::sync::Arc;

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
/// Gemma 3 270M Q4_K_M ≈ 0.5 (its 262,144-row head is computed per token); on the Zen 4
/// host (AVX-512 VNNI) since the multi-token kernels prefetch (docs/eval/speculate.md),
/// for 1 / 2 / 4 / 8 drafts: SmolLM2 0.24 / 0.29 / 0.33 / 0.26, Gemma 0.12 / 0.19 / 0.31 /
/// 0.28. One constant, not a timing, keeps the draft lengths, and so a seeded sampled
/// run, reproducible.
const COST_PER_DRAFT: f64 = 0.3;
/// Drafting is off for good when even drafts that are always accepted could not gain this
/// much (`(K + 1) / (1 + cost · K)` below it): a draft model whose step costs about as much
/// as the target's. Its probes would cost more than they could return, the draft model
/// having to read every token it missed first.
const MIN_GAIN_CEILING: f64 = 1.1;
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
    /// What a drafted token costs, in single-token steps of the target: its share of the
    /// verification pass ([`COST_PER_DRAFT`]) plus, with a draft model, the draft model's
    /// step that proposed it ([`DraftModel::step_cost`]).
    cost_per_draft: f64,
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
            cost_per_draft: COST_PER_DRAFT,
            stats: SpecStats::default(),
        }
    }

    /// Drafting with a draft model whose step costs `step_cost` target steps: each drafted
    /// token costs that on top of its share of the verification pass.
    pub(crate) fn with_draft_step_cost(mut self, step_cost: f64) -> Speculator {
        self.cost_per_draft = COST_PER_DRAFT + step_cost.max(0.0);
        self
    }

    /// How many draft tokens are worth verifying now (at most `budget`): the `k` that
    /// maximises expected tokens per pass over the pass's cost, 0 when no `k ≥ 1` beats a
    /// plain step. After a stop, 0 for `wait` steps, then a one-token probe.
    pub(crate) fn draft_len(&mut self, budget: usize) -> usize {
        let budget = budget.min(self.cfg.max_draft);
        if budget == 0 || !self.can_pay() {
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
            let gain = expect / (1.0 + self.cost_per_draft * k as f64);
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

    /// Whether drafts that are always accepted would gain at least [`MIN_GAIN_CEILING`].
    pub(crate) fn can_pay(&self) -> bool {
        let k = self.cfg.max_draft as f64;
        (k + 1.0) / (1.0 + self.cost_per_draft * k) >= MIN_GAIN_CEILING
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

/// Refuses a draft model whose vocabulary is not the target's, id for id (the drafts are
/// ids: another tokenizer's ids mean other tokens), in one line naming both files.
pub fn check_same_vocab(target: &ModelFiles, draft: &ModelFiles) -> Result<()> {
    let differs = |why: String| {
        Err(Error::flag(
            "--draft-model",
            format!(
                "{} cannot draft for {}: {why}; a draft model needs the same tokenizer",
                draft.path.display(),
                target.path.display()
            ),
        ))
    };
    let (tt, dt) = (target.tokenizer()?, draft.tokenizer()?);
    if tt.vocab_size() != dt.vocab_size() {
        return differs(format!(
            "its vocabulary has {} tokens, the target's {}",
            dt.vocab_size(),
            tt.vocab_size()
        ));
    }
    if target.config.vocab_size != draft.config.vocab_size {
        return differs(format!(
            "its output layer has {} rows, the target's {}",
            draft.config.vocab_size, target.config.vocab_size
        ));
    }
    for id in 0..tt.vocab_size() as u32 {
        let (a, b) = (tt.id_to_token(id), dt.id_to_token(id));
        if a != b {
            return differs(format!(
                "token {id} is {:?} in it and {:?} in the target",
                b.unwrap_or_default(),
                a.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// A draft model (`--draft-model FILE`, docs/design.md §3.3): a model with the target's
/// vocabulary, run greedily on its own cache (same cache settings as the target) to
/// propose drafts. Its cache follows the text: before each proposal it is fed the text's
/// tokens it has not seen (catching up after plain steps and accepted drafts), and after
/// the verification it keeps, through a [`hold`](crate::kv_cache::KvCache::hold), only
/// the rows of tokens that are now text. A greedy drafter proposes a point mass, so the
/// verification rule of [`check`] keeps the output distribution under sampling too.
pub struct DraftModel {
    run: EngineRun<Arc<Model>>,
    /// Text tokens (prompt and output, from the start) whose rows its cache holds.
    synced: usize,
    /// Of the running proposal: text tokens fed to catch up, and draft tokens proposed.
    fed: usize,
    proposed: usize,
    /// A draft-model step's cost in target steps: the ratio of the files' bytes (a decode
    /// step reads every weight once), fixed at load so runs are reproducible.
    pub step_cost: f64,
}

impl DraftModel {
    /// `model` (loaded from `draft`) drafting for the model of `target`, with the target's
    /// cache settings `kv`; refuses another vocabulary or a cache setting the draft model
    /// cannot take, naming `--draft-model`.
    pub fn new(
        model: Arc<Model>,
        draft: &ModelFiles,
        target: &ModelFiles,
        kv: &KvConfig,
    ) -> Result<DraftModel> {
        check_same_vocab(target, draft)?;
        crate::kv_cache::validate(kv, &draft.config)
            .map_err(|e| Error::flag("--draft-model", format!("{}: {e}", draft.path.display())))?;
        let step_cost = draft.file_bytes as f64 / target.file_bytes.max(1) as f64;
        Ok(DraftModel {
            run: EngineRun::new(model, kv),
            synced: 0,
            fed: 0,
            proposed: 0,
            step_cost,
        })
    }

    /// Sets the cost of a draft-model step in target steps (what the draft length
    /// weighs against the acceptance rate; by default the files' byte ratio).
    pub fn with_step_cost(mut self, step_cost: f64) -> DraftModel {
        self.step_cost = step_cost;
        self
    }

    /// Feeds the text's tokens the cache has not seen (`text[synced..]`) outside any
    /// proposal (after the prompt's prefill).
    pub(crate) fn catch_up(&mut self, text: &[u32]) -> Result<()> {
        if self.synced < text.len() {
            self.run.prefill(&text[self.synced..], self.synced)?;
            self.synced = text.len();
        }
        Ok(())
    }

    /// Up to `k` greedy draft tokens continuing `text` (prompt and output so far; `k ≥ 1`),
    /// under a hold of the draft cache that [`settle`](Self::settle) ends.
    pub(crate) fn propose(&mut self, text: &[u32], k: usize) -> Result<Vec<u32>> {
        self.run.hold()?;
        let r = self.propose_held(text, k);
        if r.is_err() {
            self.run.release(0);
            self.fed = 0;
            self.proposed = 0;
        }
        r
    }

    fn propose_held(&mut self, text: &[u32], k: usize) -> Result<Vec<u32>> {
        let n = text.len();
        let from = self.synced.min(n);
        let logits = match &text[from..] {
            [] => {
                return Err(Error::Generate(
                    "the draft model has no token to continue from".into(),
                ))
            }
            [t] => self.run.forward(*t, from)?,
            many => self.run.prefill(many, from)?,
        };
        check_finite(logits, n - 1)?;
        let mut next = crate::ops::argmax(logits) as u32;
        self.fed = n - from;
        let mut pos = n;
        let mut draft = Vec::with_capacity(k);
        draft.push(next);
        while draft.len() < k {
            let logits = self.run.forward(next, pos)?;
            check_finite(logits, pos)?;
            pos += 1;
            next = crate::ops::argmax(logits) as u32;
            draft.push(next);
        }
        self.proposed = draft.len();
        Ok(draft)
    }

    /// Ends the proposal's hold after its verification accepted the first `accepted`
    /// drafts: the cache keeps the rows of the caught-up text and of the accepted drafts
    /// it was fed (all but the last proposed one, which was never fed).
    pub(crate) fn settle(&mut self, accepted: usize) {
        let kept = accepted.min(self.proposed.saturating_sub(1));
        self.run.release(self.fed + kept);
        self.synced += self.fed + kept;
        self.fed = 0;
        self.proposed = 0;
    }
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("synced", &self.synced)
            .field("step_cost", &self.step_cost)
            .finish_non_exhaustive()
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

    /// A draft model whose step costs about what the target's does never drafts, not even
    /// a probe, however well drafts would be accepted; a cheap one drafts.
    #[test]
    fn a_draft_model_that_cannot_pay_never_drafts() {
        let mut s = Speculator::new(SpecConfig { max_draft: 8 }, &[]).with_draft_step_cost(0.7);
        for _ in 0..20 {
            s.record(8, 8);
        }
        assert!((0..300).all(|_| s.draft_len(8) == 0));
        let mut s = Speculator::new(SpecConfig { max_draft: 8 }, &[]).with_draft_step_cost(0.1);
        for _ in 0..20 {
            s.record(8, 8);
        }
        assert!(s.draft_len(8) >= 4);
    }
}
