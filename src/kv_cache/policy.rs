//! Eviction: which rows survive (docs/design.md §3), independent of how they are stored.
//!
//! Rows are numbered by their *token index* `t` (0 for the first row ever appended to
//! the layer, +1 per append). *Logical slot* `i` is a stored row's index in oldest-first
//! order; it is what `cache` positions mode rotates keys by.
//!
//! An [`EvictionPolicy`] owns that bookkeeping: at each append it decides which stored
//! row (if any) the new row replaces and which *slot* of its region the new row takes
//! (see [`EvictionPolicy::append`]); the layer and its stores only ask it. Nothing in the
//! trait assumes the stored set is a function of the number of rows appended: a
//! score-based policy (H2O, SnapKV) keeps its own state, fed by attention through
//! [`EvictionPolicy::observe`] (docs/design.md, "Extending the cache").
//!
//! [`StreamingLlm`] is the project's policy: after `T` appends under `(sink, window)` the
//! stored rows are exactly
//!
//! ```text
//!     [0, min(sink, T))  ∪  [max(sink, T − window), T)          (oldest first)
//! ```
//!
//! and without a window every row `[0, T)` is stored. That set is a pure function of
//! `T`, so every answer is closed-form and eviction costs nothing: the new row's ring
//! slot is the slot of the row it evicts.

use std::fmt::Debug;

/// Which rows a layer keeps, and where each one lives.
///
/// Tokens below [`EvictionPolicy::body_start`] (the layer's *prefix*: the rows KIVI keeps
/// at full precision) live in prefix slot `t`; later tokens live in the *body*, whose
/// slots the policy assigns (a ring of [`EvictionPolicy::body_slots`] slots, or growing).
/// `LayerKv` calls [`EvictionPolicy::append`] once per token, then reads the answers.
pub trait EvictionPolicy: Debug + Send + Sync {
    /// First token of the body region (`P`, given at construction).
    fn body_start(&self) -> usize;
    /// Slots of the body region, or `None` when it grows without bound.
    fn body_slots(&self) -> Option<usize>;
    /// Records the append of token `appended()` and evicts per the policy. Returns the
    /// new row's slot in its region (prefix slot `t` for `t < body_start()`), or `None`
    /// when the policy does not keep it.
    fn append(&mut self) -> Option<usize>;
    /// Rows appended so far (`T`).
    fn appended(&self) -> usize;
    /// Rows stored.
    fn stored(&self) -> usize;
    /// Token index held by logical slot `i` (`i < stored()`).
    fn token_at(&self, i: usize) -> usize;
    /// Whether token `tok` is stored.
    fn is_stored(&self, tok: usize) -> bool;
    /// How many of the tokens in `[lo, hi)` are stored.
    fn stored_in(&self, lo: usize, hi: usize) -> usize;
    /// The oldest stored token `≥ tok`, or `appended()` if there is none.
    fn first_stored_from(&self, tok: usize) -> usize;
    /// Slot of stored token `tok` in its region.
    fn slot(&self, tok: usize) -> usize;
    /// The end (≤ `end`) of the run of logical slots from `i` that hold consecutive
    /// tokens of one region in consecutive slots.
    fn run_end(&self, i: usize, end: usize) -> usize;
    /// Whether [`EvictionPolicy::observe`] wants attention's weights (attention skips
    /// computing them otherwise).
    fn observes(&self) -> bool {
        false
    }
    /// Attention's probability mass per stored row (logical order, summed over query
    /// heads) after a step, for score-based policies. Default: ignored.
    fn observe(&mut self, _mass: &[f32]) {}
}

/// StreamingLLM `(sink, window)`; `window = None` keeps everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamingLlm {
    pub sink: usize,
    pub window: Option<usize>,
    /// First body token `P` (`P ≥ sink`, so every body row is a non-sink row and the
    /// body evicts oldest first: a ring of `window` slots).
    pub prefix: usize,
    /// Rows appended (`T`).
    appended: usize,
}

impl StreamingLlm {
    pub fn new(sink: usize, window: Option<usize>, prefix: usize) -> Self {
        debug_assert!(prefix >= sink);
        StreamingLlm {
            sink,
            window,
            prefix,
            appended: 0,
        }
    }

    /// The policy after `appended` appends (a cache loaded from a saved state: the
    /// policy's only counter).
    pub(crate) fn set_appended(&mut self, appended: usize) {
        self.appended = appended;
    }

    /// Sink rows stored.
    #[inline]
    pub fn sinks_stored(&self) -> usize {
        self.sink.min(self.appended)
    }

    /// First token index of the recent (non-sink) run; the run is
    /// `[window_start(), appended)`.
    #[inline]
    pub fn window_start(&self) -> usize {
        let (s, t) = (self.sinks_stored(), self.appended);
        match self.window {
            None => s,
            Some(m) => s.max(t.saturating_sub(m)),
        }
    }

    #[inline]
    fn body_slot(&self, b: usize) -> usize {
        match self.window {
            Some(m) => b % m,
            None => b,
        }
    }
}

impl EvictionPolicy for StreamingLlm {
    fn body_start(&self) -> usize {
        self.prefix
    }
    fn body_slots(&self) -> Option<usize> {
        self.window
    }
    /// Never refuses a row; a body row takes ring slot `b % window`, the slot of the row
    /// it evicts.
    #[inline]
    fn append(&mut self) -> Option<usize> {
        let t = self.appended;
        self.appended += 1;
        Some(self.slot(t))
    }
    #[inline]
    fn appended(&self) -> usize {
        self.appended
    }
    #[inline]
    fn stored(&self) -> usize {
        self.sinks_stored() + (self.appended - self.window_start())
    }
    #[inline]
    fn token_at(&self, i: usize) -> usize {
        debug_assert!(i < self.stored(), "slot {i} of {} rows", self.stored());
        let s = self.sinks_stored();
        if i < s {
            i
        } else {
            self.window_start() + (i - s)
        }
    }
    #[inline]
    fn is_stored(&self, tok: usize) -> bool {
        tok < self.appended && (tok < self.sinks_stored() || tok >= self.window_start())
    }
    fn stored_in(&self, lo: usize, hi: usize) -> usize {
        let hi = hi.min(self.appended);
        if lo >= hi {
            return 0;
        }
        let (s, w) = (self.sinks_stored(), self.window_start());
        let sinks = hi.min(s).saturating_sub(lo);
        let recent = hi.saturating_sub(lo.max(w));
        sinks + recent
    }
    #[inline]
    fn first_stored_from(&self, tok: usize) -> usize {
        if tok < self.sinks_stored() {
            tok
        } else {
            tok.max(self.window_start()).min(self.appended)
        }
    }
    #[inline]
    fn slot(&self, tok: usize) -> usize {
        if tok < self.prefix {
            tok
        } else {
            self.body_slot(tok - self.prefix)
        }
    }
    /// Breaks at the sink/recent seam, the prefix/body border and the ring's wrap.
    #[inline]
    fn run_end(&self, i: usize, end: usize) -> usize {
        let s = self.sinks_stored();
        let tok = self.token_at(i);
        let mut end = if i < s { end.min(s) } else { end };
        if tok < self.prefix {
            end = end.min(i + (self.prefix - tok));
        } else if let Some(m) = self.window {
            let b = tok - self.prefix;
            end = end.min(i + ((b / m + 1) * m - b));
        }
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(p: &StreamingLlm, t: usize) -> Vec<usize> {
        // Append one by one, evicting the oldest non-sink row while over capacity.
        let mut rows: Vec<usize> = Vec::new();
        for tok in 0..t {
            rows.push(tok);
            if let Some(m) = p.window {
                while rows.len() > p.sink + m {
                    rows.remove(p.sink);
                }
            }
        }
        rows
    }

    #[test]
    fn closed_form_matches_step_by_step_eviction() {
        for sink in 0..5 {
            for window in [None, Some(1), Some(2), Some(5), Some(9)] {
                for prefix in [sink, sink + 3] {
                    let mut p = StreamingLlm::new(sink, window, prefix);
                    // slot → token of the body ring, to check a new row only ever
                    // overwrites an evicted one.
                    let mut body: Vec<Option<usize>> = Vec::new();
                    for t in 0..30 {
                        let want = brute(&p, t);
                        let got: Vec<usize> = (0..p.stored()).map(|i| p.token_at(i)).collect();
                        let ctx = format!("sink={sink} window={window:?} P={prefix} t={t}");
                        assert_eq!(got, want, "{ctx}");
                        for tok in 0..t + 2 {
                            assert_eq!(p.is_stored(tok), want.contains(&tok), "{ctx} tok={tok}");
                            let first = want.iter().copied().find(|&x| x >= tok).unwrap_or(t);
                            assert_eq!(p.first_stored_from(tok), first, "{ctx} tok={tok}");
                        }
                        for lo in 0..t + 1 {
                            for hi in lo..t + 2 {
                                let n = want.iter().filter(|&&x| x >= lo && x < hi).count();
                                assert_eq!(p.stored_in(lo, hi), n, "{ctx} [{lo},{hi})");
                            }
                        }
                        // Runs: consecutive tokens in consecutive slots of one region.
                        let mut i = 0;
                        while i < want.len() {
                            let e = p.run_end(i, want.len());
                            assert!(e > i, "{ctx}: empty run at {i}");
                            for j in i + 1..e {
                                assert_eq!(want[j], want[j - 1] + 1, "{ctx} run {i}..{e}");
                                assert_eq!(p.slot(want[j]), p.slot(want[j - 1]) + 1, "{ctx}");
                                assert_eq!(want[j] < prefix, want[i] < prefix, "{ctx}");
                            }
                            i = e;
                        }
                        let slot = p.append().unwrap();
                        assert_eq!(slot, p.slot(t));
                        if t >= prefix {
                            if body.len() <= slot {
                                body.resize(slot + 1, None);
                            }
                            if let Some(old) = body[slot] {
                                assert!(!p.is_stored(old), "{ctx}: slot {slot} held {old}");
                            }
                            body[slot] = Some(t);
                        }
                    }
                }
            }
        }
    }
}
