//! Eviction policy: which rows survive (docs/design.md §3), independent of how they are stored.
//!
//! Rows are numbered by their *token index* `t` (0 for the first row ever appended to
//! the layer, +1 per append). After `T` appends under StreamingLLM `(sink, window)`, the
//! stored rows are exactly
//!
//! ```text
//!     [0, min(sink, T))  ∪  [max(sink, T − window), T)          (oldest first)
//! ```
//!
//! and without a window every row `[0, T)` is stored. The stored set is a pure function
//! of `T`, so the policy holds no state and eviction costs nothing: the storage simply
//! overwrites ring slots (see `storage.rs`). *Logical slot* `i` is a row's index in the
//! oldest-first order above; it is what `cache` positions mode rotates keys by.

use tinygpt_reference::kv_cache::KvConfig;

/// StreamingLLM `(sink, window)`; `window = None` keeps everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub sink: usize,
    pub window: Option<usize>,
}

impl Policy {
    pub fn new(kv: &KvConfig) -> Self {
        Policy {
            sink: kv.sink,
            window: kv.window,
        }
    }

    /// Sink rows stored after `t` appends.
    #[inline]
    pub fn sinks_stored(&self, t: usize) -> usize {
        self.sink.min(t)
    }

    /// First token index of the recent (non-sink) run after `t` appends; the run is
    /// `[window_start(t), t)`.
    #[inline]
    pub fn window_start(&self, t: usize) -> usize {
        let s = self.sinks_stored(t);
        match self.window {
            None => s,
            Some(m) => s.max(t.saturating_sub(m)),
        }
    }

    /// Rows stored after `t` appends.
    #[inline]
    pub fn stored(&self, t: usize) -> usize {
        self.sinks_stored(t) + (t - self.window_start(t))
    }

    /// Token index held by logical slot `i` after `t` appends (`i < stored(t)`).
    #[inline]
    pub fn token_at(&self, t: usize, i: usize) -> usize {
        debug_assert!(i < self.stored(t), "slot {i} of {} rows", self.stored(t));
        let s = self.sinks_stored(t);
        if i < s {
            i
        } else {
            self.window_start(t) + (i - s)
        }
    }

    /// Whether token `tok` is stored after `t` appends.
    #[inline]
    pub fn is_stored(&self, t: usize, tok: usize) -> bool {
        tok < t && (tok < self.sinks_stored(t) || tok >= self.window_start(t))
    }

    /// How many of the tokens in `[lo, hi)` are stored after `t` appends.
    pub fn stored_in(&self, t: usize, lo: usize, hi: usize) -> usize {
        let hi = hi.min(t);
        if lo >= hi {
            return 0;
        }
        let s = self.sinks_stored(t);
        let w = self.window_start(t);
        let sinks = hi.min(s).saturating_sub(lo);
        let recent = hi.saturating_sub(lo.max(w));
        sinks + recent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(p: &Policy, t: usize) -> Vec<usize> {
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
                let p = Policy { sink, window };
                for t in 0..30 {
                    let want = brute(&p, t);
                    let got: Vec<usize> = (0..p.stored(t)).map(|i| p.token_at(t, i)).collect();
                    assert_eq!(got, want, "sink={sink} window={window:?} t={t}");
                    for tok in 0..t + 2 {
                        assert_eq!(p.is_stored(t, tok), want.contains(&tok), "tok={tok}");
                    }
                    for lo in 0..t + 1 {
                        for hi in lo..t + 2 {
                            let n = want.iter().filter(|&&x| x >= lo && x < hi).count();
                            assert_eq!(
                                p.stored_in(t, lo, hi),
                                n,
                                "sink={sink} window={window:?} t={t} [{lo},{hi})"
                            );
                        }
                    }
                }
            }
        }
    }
}
