//! Rows held before they are committed (docs/design.md §3.2): the one API that
//! speculative decoding (verify drafted tokens, keep the accepted ones) and the prompt
//! cache (keep a finished sequence's state, resume it from any point after its prompt)
//! both stand on.
//!
//! [`LayerKv::hold`] starts a hold: from then on every append goes into the cache exactly
//! as without one (attention sees the held rows, eviction and KIVI groups run as usual:
//! there is no second code path to keep equal), and the hold also remembers what it needs
//! to undo them. [`LayerKv::release`]`(keep)` ends the hold keeping the first `keep` held
//! rows: the layer is then **bit for bit** the layer that only ever appended those rows
//! (stored rows, positions, slots, KIVI groups and residual, everything later appends
//! depend on), whatever evictions and quantisations the dropped rows caused.
//!
//! How it undoes (an implementation detail behind the API): the hold keeps a copy of the
//! layer as it was when the hold began, plus every held row as it arrived at
//! [`LayerKv::append`]; a release that drops rows restores the copy and appends the kept
//! rows again (appends are deterministic in the rows and the state, so replaying them
//! yields the same bits). Cost: one copy of the layer per hold, and `keep` appends per
//! release that drops rows ([`LayerKv::hold_bytes`] counts what a hold keeps).
//! [`LayerKv::released_copy`] does the same restore-and-replay on a copy, leaving the
//! layer and its hold as they are (the server's prompt cache resumes a kept state this
//! way and keeps the state for later requests).

use super::{EvictionPolicy, LayerKv};

/// What a layer keeps while it holds rows (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Held<P> {
    /// The layer when the hold began (holding nothing itself).
    base: LayerKv<P>,
    /// The held rows as they arrived at [`LayerKv::append`], `(held, kv_dim)` each.
    k: Vec<f32>,
    v: Vec<f32>,
    pos: Vec<usize>,
}

impl<P> Held<P> {
    /// Records one append.
    pub(super) fn record(&mut self, k: &[f32], v: &[f32], pos: usize) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.pos.push(pos);
    }
}

impl<P: EvictionPolicy + Clone> LayerKv<P> {
    /// Starts holding: rows appended from now on can be dropped again by
    /// [`release`](Self::release). A hold already running is committed first (its rows
    /// all kept).
    pub fn hold(&mut self) {
        self.release(usize::MAX);
        let mut base = self.clone();
        base.probe = None;
        self.held = Some(Box::new(Held {
            base,
            k: Vec::new(),
            v: Vec::new(),
            pos: Vec::new(),
        }));
    }

    /// Rows appended since the hold began, or `None` when not holding.
    pub fn held(&self) -> Option<usize> {
        self.held.as_ref().map(|h| h.pos.len())
    }

    /// Ends the hold, keeping the first `keep` held rows (all of them when `keep` ≥
    /// [`held`](Self::held)): the layer is then bit for bit the layer that appended only
    /// the rows before the hold and those `keep`. Without a hold, does nothing.
    pub fn release(&mut self, keep: usize) {
        let Some(held) = self.held.take() else {
            return;
        };
        let held = *held;
        if keep >= held.pos.len() {
            return;
        }
        let probe = self.probe.take();
        *self = held.base;
        self.replay(&held.k, &held.v, &held.pos[..keep]);
        self.probe = probe;
    }

    /// Appends the held rows `pos` (the first `pos.len()` of `k` and `v`) again.
    fn replay(&mut self, k: &[f32], v: &[f32], pos: &[usize]) {
        let d = self.kv_heads * self.head_dim;
        for (i, &p) in pos.iter().enumerate() {
            self.append(&k[i * d..(i + 1) * d], &v[i * d..(i + 1) * d], p);
        }
    }

    /// A copy of the layer as [`release`](Self::release)`(keep)` would leave it, this
    /// layer unchanged (its hold still running): the same restore-and-replay, on a copy
    /// of the hold's base instead of this layer, so the layer and its hold are never
    /// copied whole. Without a hold, a copy of the layer.
    pub fn released_copy(&mut self, keep: usize) -> Self {
        let held = self.held.take();
        let copy = match held.as_deref() {
            Some(h) if keep < h.pos.len() => {
                let mut c = h.base.clone();
                c.replay(&h.k, &h.v, &h.pos[..keep]);
                c
            }
            _ => self.clone(),
        };
        self.held = held;
        copy
    }

    /// Bytes a running hold keeps beside the stored rows (its copy of the layer and the
    /// held rows as f32); 0 without a hold.
    pub fn hold_bytes(&self) -> usize {
        self.held.as_ref().map_or(0, |h| {
            h.base.bytes() + 4 * (h.k.len() + h.v.len()) + 8 * h.pos.len()
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::kv_cache::{KvConfig, LayerKv, PositionsMode, Precision};

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Everything observable about a layer: appended count, positions, every stored K
    /// and V row of every head (dequantised, as attention reads them), bytes.
    fn snapshot(layer: &LayerKv) -> (usize, Vec<usize>, Vec<Vec<u32>>, usize) {
        let mut rows = Vec::new();
        for i in 0..layer.len() {
            rows.push(bits(&layer.key(i)));
            rows.push(bits(&layer.value(i)));
        }
        (layer.appended(), layer.positions(), rows, layer.bytes())
    }

    /// A deterministic row with a wide range (so KIVI scales differ group to group),
    /// and a constant channel (scale 0 in a per-channel K group).
    fn row(t: usize, salt: f32, dim: usize) -> Vec<f32> {
        (0..dim)
            .map(|c| match c {
                0 => 1.5,
                _ => ((t * 31 + c * 7) as f32 * 0.37 + salt).sin() * (1.0 + (t % 5) as f32 * 40.0),
            })
            .collect()
    }

    /// For every precision pair, sink/window/residual/group shape and split point: hold
    /// after `a` rows, append `n`, release keeping `keep` (every value `0..=n` and beyond).
    /// During the hold the layer equals the layer that appended all `a + n` rows; after
    /// the release it equals the layer that appended only `a + keep`, and stays equal
    /// over 2·window more appends (so hidden state — ring slots, group progress, the
    /// residual — was restored too).
    #[test]
    fn release_equals_never_having_appended() {
        let (kv_heads, hd) = (2usize, 8usize);
        let dim = kv_heads * hd;
        let sides = Precision::ALL.iter().map(|&p| (p, None)).chain([
            (Precision::Int8, Some(Precision::Int4)),
            (Precision::Fp16, Some(Precision::Int2)),
        ]);
        for (precision, v_precision) in sides {
            for (g, sink, window, residual) in [
                (4usize, 0usize, None, 0usize),
                (3, 0, None, 5),
                (4, 2, Some(7), 0),
                (4, 2, Some(7), 9),
                (5, 6, Some(5), 4),
                (2, 1, Some(1), 1),
            ] {
                let kv = KvConfig {
                    precision,
                    v_precision,
                    group_size: g,
                    sink,
                    window,
                    residual,
                    positions: PositionsMode::Cache,
                    ..KvConfig::default()
                };
                for a in [0usize, 1, 3, 6, 11] {
                    for n in [1usize, 4, 9] {
                        for keep in 0..=n + 1 {
                            let ctx = format!(
                                "{precision:?}/{v_precision:?} G={g} R={residual} sink={sink} \
                                 window={window:?} a={a} n={n} keep={keep}"
                            );
                            let mut held = LayerKv::new(&kv, kv_heads, hd);
                            let mut all = LayerKv::new(&kv, kv_heads, hd);
                            let mut kept = LayerKv::new(&kv, kv_heads, hd);
                            for t in 0..a {
                                held.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                                all.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                                kept.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                            }
                            held.hold();
                            assert_eq!(held.held(), Some(0), "{ctx}");
                            for t in a..a + n {
                                held.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                                all.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                                if t < a + keep {
                                    kept.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                                }
                            }
                            assert_eq!(held.held(), Some(n), "{ctx}");
                            assert!(held.hold_bytes() > 0, "{ctx}");
                            assert_eq!(snapshot(&held), snapshot(&all), "{ctx}: during the hold");
                            let mut copy = held.released_copy(keep);
                            assert_eq!(held.held(), Some(n), "{ctx}: the copy leaves the hold");
                            assert_eq!(copy.held(), None, "{ctx}");
                            assert_eq!(snapshot(&copy), snapshot(&kept), "{ctx}: released copy");
                            held.release(keep);
                            assert_eq!(held.held(), None, "{ctx}");
                            assert_eq!(held.hold_bytes(), 0, "{ctx}");
                            assert_eq!(snapshot(&held), snapshot(&kept), "{ctx}: after release");
                            let from = a + keep.min(n);
                            for t in from..from + 2 * window.unwrap_or(4) + g {
                                held.append(&row(t, 2.0, dim), &row(t, 3.0, dim), t);
                                kept.append(&row(t, 2.0, dim), &row(t, 3.0, dim), t);
                                copy.append(&row(t, 2.0, dim), &row(t, 3.0, dim), t);
                                assert_eq!(snapshot(&held), snapshot(&kept), "{ctx}: later t={t}");
                                assert_eq!(snapshot(&copy), snapshot(&kept), "{ctx}: copy t={t}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// A second hold commits the first one's rows; a release without a hold changes
    /// nothing.
    #[test]
    fn holds_do_not_nest() {
        let kv = KvConfig {
            precision: Precision::Int4,
            group_size: 4,
            sink: 2,
            window: Some(6),
            residual: 2,
            ..KvConfig::default()
        };
        let (kv_heads, hd) = (1usize, 8usize);
        let mut layer = LayerKv::new(&kv, kv_heads, hd);
        let mut want = LayerKv::new(&kv, kv_heads, hd);
        layer.hold();
        for t in 0..5 {
            layer.append(&row(t, 0.0, hd), &row(t, 1.0, hd), t);
            want.append(&row(t, 0.0, hd), &row(t, 1.0, hd), t);
        }
        layer.hold();
        layer.append(&row(5, 0.0, hd), &row(5, 1.0, hd), 5);
        layer.release(0);
        assert_eq!(snapshot(&layer), snapshot(&want));
        layer.release(0);
        assert_eq!(snapshot(&layer), snapshot(&want));
    }
}
