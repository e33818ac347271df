//! Attention split within a KV head, for a decode team: the scores of row ranges
//! ([`score_rows`]), then the softmax and weighted sum of runs of query heads
//! ([`mix_query_heads`]), bit for bit what whole KV heads give
//! ([`attend_heads`](super::attend_heads)); when to split ([`AttnSplit`]) and how the work
//! is cut and the scores laid out between the two ([`SplitPlan`]).

use super::{hadamard, score_range, weigh, HeadScratch, RopeTable, Step, StepTables, BLOCK};
use crate::config::Config;
use crate::kv_cache::{EvictionPolicy, LayerKv};
use std::ops::Range;

/// Whether a decode team splits each KV head's attention between its members
/// ([`score_rows`], then [`mix_query_heads`]) instead of giving each member whole KV heads
/// ([`attend_heads`](super::attend_heads)). The results are the same bit for bit either
/// way; only the balance between members (and one more sync per layer) differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnSplit {
    /// When it pays: at least [`SPLIT_MIN_ROWS`] stored rows, and whole KV heads would
    /// leave the members unevenly loaded (the KV heads are not a multiple of the team
    /// size, e.g. SmolLM2's 3 or Gemma 3's 1 on 2 threads).
    #[default]
    Auto,
    /// Always (tests).
    Always,
    /// Never (tests, A/B runs).
    Never,
}

/// Stored rows from which [`AttnSplit::Auto`] splits a KV head. Below it attention is a
/// small part of the step and one more sync per layer costs about what the balance gains.
pub const SPLIT_MIN_ROWS: usize = 256;

impl AttnSplit {
    /// Whether a team of `members` splits a layer of `n_kv_heads` KV heads holding
    /// `stored` rows (then [`SplitPlan::new`] cuts it).
    pub fn splits(self, n_kv_heads: usize, members: usize, stored: usize) -> bool {
        match self {
            AttnSplit::Always => true,
            AttnSplit::Never => false,
            AttnSplit::Auto => {
                members > 1 && !n_kv_heads.is_multiple_of(members) && stored >= SPLIT_MIN_ROWS
            }
        }
    }
}

/// Raw scores (before the `1/√d` scale) of KV head `h`'s query heads against stored rows
/// `rows` of a step [`prepare_step`](super::prepare_step) has prepared:
/// `out[j * stride + i - rows.start]` for query head `j` of the group and row `i`. Each
/// row's score is bit for bit the one [`attend_heads`](super::attend_heads) computes,
/// whatever the range (the kernels' contract), so a decode team can score one KV head in
/// several ranges. `hs` is the caller's scratch (only its
/// `fold`, `block` and `params` are used).
#[allow(clippy::too_many_arguments)]
pub fn score_rows<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    tables: &StepTables,
    h: usize,
    rows: Range<usize>,
    hs: &mut HeadScratch,
    out: &mut [f32],
    stride: usize,
) {
    let (hd, group) = (cfg.head_dim, cfg.group());
    debug_assert!(rows.end <= layer.len() && rows.len() <= stride);
    debug_assert!(out.len() >= (group - 1) * stride + rows.len());
    let step = Step::new(cfg, rope, layer, tables);
    hs.fold.resize(group * hd, 0.0);
    hs.block.resize(BLOCK * hd, 0.0);
    hs.params.resize(2 * hd, 0.0);
    let qh = &tables.q[h * group * hd..(h + 1) * group * hd];
    let scratch = (&mut hs.fold[..], &mut hs.block[..], &mut hs.params[..]);
    score_range(&step, h, qh, rows, scratch, out, stride);
}

/// Consecutive query heads of KV head `h`, after [`score_rows`]: `p` (their raw scores
/// over every stored row, `(k, stored)`) becomes their softmax weights in place, and
/// `out` (`(k, head_dim)`) their attention output — bit for bit what
/// [`attend_heads`](super::attend_heads) computes for those query heads (each query's sum
/// of values does not depend on how many queries share the kernel call, which reads each
/// value row once for all of them).
pub fn mix_query_heads<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    tables: &StepTables,
    h: usize,
    p: &mut [f32],
    out: &mut [f32],
) {
    let (hd, n) = (cfg.head_dim, layer.len());
    let k = out.len() / hd;
    debug_assert!(p.len() == k * n && out.len() == k * hd && k > 0);
    let step = Step::new(cfg, rope, layer, tables);
    for scores in p.chunks_exact_mut(n) {
        weigh(&step, scores);
    }
    out.fill(0.0);
    let mut bias = vec![0.0f32; k];
    step.layer.for_each_value_run(h, |run| {
        run.rows
            .axpy_rows(step.kv, &p[run.first..], n, out, &mut bias);
    });
    for (o, &b) in out.chunks_exact_mut(hd).zip(&bias) {
        if b != 0.0 {
            o.iter_mut().for_each(|x| *x += b);
        }
    }
    if layer.config().rotates(hd) {
        hadamard::rotate_heads(out, hd);
    }
}

/// How a team of `members` splits one layer's attention over `n` stored rows: first the
/// scoring units, then the mixing units.
///
/// * A scoring unit is one KV head's range of rows, a multiple of 16 rows long (the last
///   of a head may be shorter): about four units per member over all KV heads, so a late
///   member's share is taken by the others ([`score_rows`]). A row's score does not depend
///   on how the rows are cut (the kernels' contract).
/// * A mixing unit is a run of `group / members` consecutive query heads of one KV head
///   (at least one; the last of a head may be shorter): Gemma 3's four on two members go
///   two by two, so a member reads each value row once for its run ([`mix_query_heads`]).
///
/// The scores lie unit after unit: unit `(h, rows)` holds its `(group, rows.len())` scores
/// at [`SplitPlan::score_at`] `= h · group · n + group · rows.start`, one contiguous block
/// per unit; [`SplitPlan::gather`] reads a mixing unit's scores back out of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    /// stored rows
    n: usize,
    /// query heads per KV head
    group: usize,
    n_kv_heads: usize,
    /// rows per scoring unit
    chunk: usize,
    /// scoring units per KV head
    per_head: usize,
    /// query heads per mixing unit
    per: usize,
    /// mixing units per KV head
    runs: usize,
}

impl SplitPlan {
    pub fn new(n: usize, members: usize, n_kv_heads: usize, group: usize) -> Self {
        let ranges = (4 * members).div_ceil(n_kv_heads).max(1);
        let chunk = n.div_ceil(ranges).next_multiple_of(16).max(16);
        let per = (group / members).max(1);
        SplitPlan {
            n,
            group,
            n_kv_heads,
            chunk,
            per_head: n.div_ceil(chunk),
            per,
            runs: group.div_ceil(per),
        }
    }

    /// How many scoring units.
    pub fn score_units(&self) -> usize {
        self.n_kv_heads * self.per_head
    }

    /// Scoring unit `u`: its KV head and rows.
    pub fn score_unit(&self, u: usize) -> (usize, Range<usize>) {
        let (h, k) = (u / self.per_head, u % self.per_head);
        (h, k * self.chunk..((k + 1) * self.chunk).min(self.n))
    }

    /// Where scoring unit `u`'s scores start (`u` = [`SplitPlan::score_units`]: the end of
    /// the last one, `n_heads · n`).
    pub fn score_at(&self, u: usize) -> usize {
        let (h, k) = (u / self.per_head, u % self.per_head);
        h * self.group * self.n + self.group * (k * self.chunk).min(self.n)
    }

    /// How many mixing units.
    pub fn mix_units(&self) -> usize {
        self.n_kv_heads * self.runs
    }

    /// Mixing unit `u`: its KV head and query heads (within the head's group).
    pub fn mix_unit(&self, u: usize) -> (usize, Range<usize>) {
        let (h, j0) = (u / self.runs, (u % self.runs) * self.per);
        (h, j0..(j0 + self.per).min(self.group))
    }

    /// The first query head (of all) of mixing unit `u` (`u` = [`SplitPlan::mix_units`]:
    /// `n_heads`).
    pub fn mix_head(&self, u: usize) -> usize {
        let (h, js) = self.mix_unit(u);
        h * self.group + js.start
    }

    /// The raw scores of KV head `h`'s query heads `js` (within its group), `(js.len(), n)`,
    /// from the scores laid out unit by unit, into `out` (as [`mix_query_heads`] takes
    /// them).
    pub fn gather(&self, scores: &[f32], h: usize, js: Range<usize>, out: &mut Vec<f32>) {
        let n = self.n;
        out.clear();
        out.resize(js.len() * n, 0.0);
        for k in 0..self.per_head {
            let (_, rows) = self.score_unit(h * self.per_head + k);
            let len = rows.len();
            let block = &scores[self.score_at(h * self.per_head + k)..][..self.group * len];
            for (i, j) in js.clone().enumerate() {
                out[i * n + rows.start..i * n + rows.end]
                    .copy_from_slice(&block[j * len..(j + 1) * len]);
            }
        }
    }
}
