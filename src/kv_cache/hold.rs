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
//! ## How it undoes (an implementation detail behind the API)
//! An undo journal per append, kept where the writes happen:
//!
//! * every store (`storage/journal.rs`, one [`Journal`] per store) saves, before each
//!   write of a held append, the elements the write overwrites that existed before it
//!   (a ring slot's row, a KIVI K group's codes and `(scale, zero)`, a residual ring row,
//!   a KIVI V row's codes and per-token `(scale, zero)`) and the buffer's length (a write
//!   past the end only grows the buffer: nothing is copied, the undo truncates);
//! * the layer journals its positions the same way (prefix and body slots), and keeps the
//!   policy as it was before each held append (a clone: `StreamingLlm` is four words).
//!
//! `release(keep)` undoes the appends after the first `keep`, newest first, each write put
//! back byte for byte and each buffer truncated to its old length, and puts back the policy
//! from before the first dropped append. Why that is the layer that appended only the
//! kept rows: the held appends ran through the normal path, so after the first `keep` of
//! them the layer *was* that layer; undoing each later append restores exactly the state
//! before it (its writes restored in reverse order, the policy snapshot taken before it),
//! by induction back to the state after the `keep`-th. Nothing is replayed, and the held
//! rows are not kept as they arrived.
//!
//! Cost: `hold()` is O(1) (an empty journal per store, nothing copied). A held append costs
//! the normal append plus copying what it overwrites: nothing while buffers grow, one row
//! per side once a ring wraps, plus a KIVI K group's codes and parameters when it
//! completes a group (G rows, amortised one per append), plus one policy clone.
//! `release(keep)` is O(what the dropped appends overwrote), committing (`keep ≥ held`) is
//! O(1) apart from freeing the journals; never O(cache). [`LayerKv::hold_bytes`] counts the
//! journals and snapshots.
//!
//! [`LayerKv::rewind`]`(keep)` undoes the same appends but holds on: the journals keep
//! the first `keep` appends' shares (each journal is cut at the `keep`-th mark, the policy
//! snapshots truncated), so the hold is then exactly the hold that only ever saw those
//! rows, and a later `release(k)` / `released_copy(k)` with `k ≤ keep`, or more held
//! appends, behave as if the dropped rows had never been appended. It lets speculative
//! decoding verify a draft inside a hold that already runs (the server's prompt cache
//! holds a kept sequence's generated rows, and holds do not nest): the draft's rows are
//! appended under that hold and rewound to the rows held before plus the accepted ones.
//!
//! [`LayerKv::released_copy`] gives a copy of the layer as `release(keep)` would leave it,
//! the layer and its hold unchanged (the server's prompt cache resumes a kept state this
//! way and keeps the state, hold included, for later requests): a copy, then a release
//! on the copy.

use super::storage::journal::{self, Journal};
use super::{EvictionPolicy, LayerKv};

/// Journal field ids of the layer's positions.
const PREFIX_POS: u8 = 0;
const BODY_POS: u8 = 1;

/// What a layer keeps while it holds rows (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Held<P> {
    /// Rows appended when the hold began.
    start: usize,
    /// The policy before each held append.
    policies: Vec<P>,
    /// The positions' journal (fields [`PREFIX_POS`], [`BODY_POS`]).
    pos: Journal,
}

impl<P: Clone> Held<P> {
    /// Opens one held append, `policy` being the policy before it.
    pub(super) fn record(&mut self, policy: &P) {
        self.policies.push(policy.clone());
        self.pos.mark();
    }
}

/// `buf[slot] = pos` for a row of the prefix (`body` false) or the body, journaled when
/// `held`.
pub(super) fn set_position<P>(
    held: Option<&mut Held<P>>,
    body: bool,
    buf: &mut Vec<usize>,
    slot: usize,
    pos: usize,
) {
    let field = if body { BODY_POS } else { PREFIX_POS };
    let mut idle = Journal::default();
    let j = held.map_or(&mut idle, |h| &mut h.pos);
    j.write(field, 0, buf, slot..slot + 1)[0] = pos;
}

impl<P: EvictionPolicy + Clone> LayerKv<P> {
    /// Starts holding: rows appended from now on can be dropped again by
    /// [`release`](Self::release). A hold already running is committed first (its rows
    /// all kept).
    pub fn hold(&mut self) {
        self.release(usize::MAX);
        let mut pos = Journal::default();
        pos.hold();
        self.held = Some(Box::new(Held {
            start: self.appended(),
            policies: Vec::new(),
            pos,
        }));
        self.prefix_k.hold();
        self.prefix_v.hold();
        self.body_k.hold();
        self.body_v.hold();
    }

    /// Rows appended since the hold began, or `None` when not holding.
    pub fn held(&self) -> Option<usize> {
        self.held.as_ref().map(|h| h.policies.len())
    }

    /// Ends the hold, keeping the first `keep` held rows (all of them when `keep` ≥
    /// [`held`](Self::held)): the layer is then bit for bit the layer that appended only
    /// the rows before the hold and those `keep`. Without a hold, does nothing.
    pub fn release(&mut self, keep: usize) {
        if self.held.is_none() {
            return;
        }
        self.rewind(keep);
        self.held = None;
        self.prefix_k.stop_holding();
        self.prefix_v.stop_holding();
        self.body_k.stop_holding();
        self.body_v.stop_holding();
    }

    /// Drops the held rows after the first `keep` and **holds on**: the layer is then bit
    /// for bit the layer that appended only the rows before the hold and those `keep`,
    /// and its hold is the hold of those `keep` rows (`held()` is `keep`; a later
    /// `release(k)` or `released_copy(k)` with `k ≤ keep` works as if the dropped rows
    /// had never been appended, and so does appending more). What lets a draft be
    /// verified inside a hold that is already running (the server's prompt cache holds a
    /// kept sequence's generated rows; holds do not nest): append the draft's rows, then
    /// rewind to the rows held before plus those accepted. Nothing when `keep` ≥
    /// [`held`](Self::held), or without a hold.
    pub fn rewind(&mut self, keep: usize) {
        let Some(held) = self.held.as_deref_mut() else {
            return;
        };
        if keep >= held.policies.len() {
            return;
        }
        // Each store saw the held appends of its region: tokens [start, start + keep)
        // split at the prefix length P.
        let (p, start) = (self.prefix, held.start);
        let end = start + keep;
        let prefix_keep = end.min(p).saturating_sub(start);
        let body_keep = end.saturating_sub(start.max(p));
        self.prefix_k.rewind(prefix_keep);
        self.prefix_v.rewind(prefix_keep);
        self.body_k.rewind(body_keep);
        self.body_v.rewind(body_keep);
        let (prefix_pos, body_pos) = (&mut self.prefix_pos, &mut self.body_pos);
        held.pos.rewind(keep, |field, _, at, old, len| {
            let buf = if field == BODY_POS {
                &mut *body_pos
            } else {
                &mut *prefix_pos
            };
            journal::restore(buf, at, old, len)
        });
        self.policy = held.policies.swap_remove(keep);
        held.policies.truncate(keep);
    }

    /// A copy of the layer as [`release`](Self::release)`(keep)` would leave it, this
    /// layer unchanged (its hold still running): the layer is copied (with its journals)
    /// and the copy released. Without a hold, a copy of the layer.
    pub fn released_copy(&mut self, keep: usize) -> Self {
        let mut copy = self.clone();
        copy.release(keep);
        copy
    }

    /// Bytes a running hold keeps beside the stored rows: the stores' and positions'
    /// journals (what the held appends overwrote, with their bookkeeping) and the policy
    /// snapshots; 0 without a hold. Right after [`hold`](Self::hold) it is a small
    /// constant, whatever the layer stores.
    pub fn hold_bytes(&self) -> usize {
        self.held.as_ref().map_or(0, |h| {
            std::mem::size_of::<Held<P>>()
                + h.policies.len() * std::mem::size_of::<P>()
                + h.pos.bytes()
                + self.prefix_k.hold_bytes()
                + self.prefix_v.hold_bytes()
                + self.body_k.hold_bytes()
                + self.body_v.hold_bytes()
        })
    }

    /// Calls `f` with the size of each heap block a copy of the layer allocates beside
    /// the layer itself (0 stands for no block): positions, each store and its blocks,
    /// the probe, the hold. What [`KvCache::copy_blocks`](super::KvCache::copy_blocks)
    /// sums over the layers.
    pub fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        f(std::mem::size_of_val(self.prefix_pos.as_slice()));
        f(std::mem::size_of_val(self.body_pos.as_slice()));
        f(std::mem::size_of_val(&*self.prefix_k));
        self.prefix_k.copy_blocks(f);
        f(std::mem::size_of_val(&*self.prefix_v));
        self.prefix_v.copy_blocks(f);
        f(std::mem::size_of_val(&*self.body_k));
        self.body_k.copy_blocks(f);
        f(std::mem::size_of_val(&*self.body_v));
        self.body_v.copy_blocks(f);
        if let Some(p) = &self.probe {
            f(std::mem::size_of_val(&**p));
            f(std::mem::size_of_val(p.0.as_slice()));
            f(std::mem::size_of_val(p.1.as_slice()));
        }
        if let Some(h) = &self.held {
            f(std::mem::size_of::<Held<P>>());
            f(std::mem::size_of_val(h.policies.as_slice()));
            h.pos.copy_blocks(f);
        }
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

    /// `(G, sink, window, residual)` of the many-cycle tests.
    const CYCLE_SHAPES: [(usize, usize, Option<usize>, usize); 3] =
        [(4, 2, Some(7), 3), (3, 0, None, 4), (2, 1, Some(3), 0)];

    /// A seeded xorshift: `rand(m)` is in `0..m` (so a failure reproduces).
    fn xorshift(mut state: u64) -> impl FnMut(usize) -> usize {
        move |m| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        }
    }

    /// Every precision pair (K = V, and two K ≠ V) under `(G, sink, window, residual)`.
    fn configs(shapes: &[(usize, usize, Option<usize>, usize)]) -> Vec<KvConfig> {
        let sides = Precision::ALL.iter().map(|&p| (p, None)).chain([
            (Precision::Int8, Some(Precision::Int4)),
            (Precision::Fp16, Some(Precision::Int2)),
        ]);
        let mut out = Vec::new();
        for (precision, v_precision) in sides {
            for &(group_size, sink, window, residual) in shapes {
                out.push(KvConfig {
                    precision,
                    v_precision,
                    group_size,
                    sink,
                    window,
                    residual,
                    positions: PositionsMode::Cache,
                    ..KvConfig::default()
                });
            }
        }
        out
    }

    fn ctx_of(kv: &KvConfig) -> String {
        format!(
            "{:?}/{:?} G={} R={} sink={} window={:?}",
            kv.precision, kv.v_precision, kv.group_size, kv.residual, kv.sink, kv.window
        )
    }

    /// Holds long enough to wrap the window ring three times and complete two KIVI K
    /// groups beyond that (n = 3·window + 2G), released at the ends and in between: the
    /// undone appends overwrote ring slots several times over (the journal must give back
    /// the oldest contents) and completed groups whose parameter slots wrapped too.
    #[test]
    fn holds_spanning_window_wraps_and_group_completions() {
        let (kv_heads, hd) = (2usize, 8usize);
        let dim = kv_heads * hd;
        let shapes = [
            (4usize, 2usize, Some(7usize), 0usize),
            (3, 4, Some(5), 2),
            (2, 0, Some(6), 5),
            (5, 1, Some(4), 9),
        ];
        for kv in configs(&shapes) {
            let (w, g) = (kv.window.unwrap_or(0), kv.group_size);
            let n = 3 * w + 2 * g;
            for a in [0usize, 5, 2 * w + 1] {
                for keep in [0, 1, w - 1, w + 1, 2 * w + g, n - 1, n] {
                    let ctx = format!("{} a={a} n={n} keep={keep}", ctx_of(&kv));
                    let mut held = LayerKv::new(&kv, kv_heads, hd);
                    let mut kept = LayerKv::new(&kv, kv_heads, hd);
                    for t in 0..a + keep {
                        kept.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                    }
                    for t in 0..a {
                        held.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                    }
                    held.hold();
                    for t in a..a + n {
                        held.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                    }
                    assert_eq!(held.held(), Some(n), "{ctx}");
                    held.release(keep);
                    assert_eq!(snapshot(&held), snapshot(&kept), "{ctx}: after release");
                    for t in a + keep..a + keep + 2 * w + g {
                        held.append(&row(t, 2.0, dim), &row(t, 3.0, dim), t);
                        kept.append(&row(t, 2.0, dim), &row(t, 3.0, dim), t);
                    }
                    assert_eq!(snapshot(&held), snapshot(&kept), "{ctx}: later");
                }
            }
        }
    }

    /// Speculative decoding's pattern: hundreds of hold / append a few / release with a
    /// random keep on one layer, compared after every release with a layer that was only
    /// ever given the kept rows (seeded, so a failure reproduces).
    #[test]
    fn repeated_hold_release_cycles() {
        let (kv_heads, hd) = (2usize, 8usize);
        let dim = kv_heads * hd;
        for kv in configs(&CYCLE_SHAPES) {
            let mut rand = xorshift(0x9E37_79B9_7F4A_7C15u64);
            let mut layer = LayerKv::new(&kv, kv_heads, hd);
            let mut kept = LayerKv::new(&kv, kv_heads, hd);
            let mut t = 0usize;
            for cycle in 0..300 {
                let ctx = format!("{} cycle={cycle} t={t}", ctx_of(&kv));
                layer.hold();
                let n = 1 + rand(6);
                // The drafted rows differ cycle to cycle even at the same t: a rejected
                // draft must leave no trace.
                let salt = cycle as f32 * 0.01;
                for i in 0..n {
                    let (k, v) = (row(t + i, salt, dim), row(t + i, 1.0 + salt, dim));
                    layer.append(&k, &v, t + i);
                }
                let keep = rand(n + 1);
                layer.release(keep);
                for i in 0..keep {
                    let (k, v) = (row(t + i, salt, dim), row(t + i, 1.0 + salt, dim));
                    kept.append(&k, &v, t + i);
                }
                t += keep;
                assert_eq!(layer.hold_bytes(), 0, "{ctx}");
                assert_eq!(
                    snapshot(&layer),
                    snapshot(&kept),
                    "{ctx}: keep={keep} of {n}"
                );
                // Plain decoding's corrected token, appended outside a hold.
                if rand(2) == 0 {
                    layer.append(&row(t, 5.0, dim), &row(t, 6.0, dim), t);
                    kept.append(&row(t, 5.0, dim), &row(t, 6.0, dim), t);
                    t += 1;
                }
            }
            assert!(t > 300, "{}: only {t} rows kept", ctx_of(&kv));
        }
    }

    /// `hold()` copies nothing: right after it, `hold_bytes()` is the same small constant
    /// for an empty layer and for one of thousands of stored rows; after `n` held appends
    /// it is bounded by `n` rows' worth (plus one KIVI group), far below the cache.
    #[test]
    fn hold_does_not_copy_the_cache() {
        let (kv_heads, hd) = (2usize, 64usize);
        let dim = kv_heads * hd;
        let shapes = [(32usize, 4usize, Some(508usize), 16usize), (32, 0, None, 0)];
        for kv in configs(&shapes) {
            let ctx = ctx_of(&kv);
            let mut empty = LayerKv::new(&kv, kv_heads, hd);
            empty.hold();
            let at_hold = empty.hold_bytes();
            assert!(
                at_hold > 0 && at_hold <= 256,
                "{ctx}: {at_hold} bytes at hold"
            );
            let mut layer = LayerKv::new(&kv, kv_heads, hd);
            for t in 0..2000 {
                layer.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
            }
            layer.hold();
            assert_eq!(
                layer.hold_bytes(),
                at_hold,
                "{ctx}: hold() copied something"
            );
            // Per append at most two f32 K + V rows' worth (the rows it overwrites, a KIVI
            // V row it quantises, per-write bookkeeping), plus one KIVI K group's worth
            // (a group completed by the first held append saves its codes).
            let f32_row = 2 * dim * 4;
            let group = kv.group_size * f32_row;
            for n in [1usize, 5, 40] {
                let mut l = layer.clone();
                for t in 2000..2000 + n {
                    l.append(&row(t, 0.0, dim), &row(t, 1.0, dim), t);
                }
                let bound = at_hold + group + n * 2 * f32_row;
                let got = l.hold_bytes();
                assert!(got <= bound, "{ctx} n={n}: {got} > {bound}");
                if n == 1 {
                    let cache = layer.bytes();
                    assert!(
                        got < cache / 8,
                        "{ctx}: {got} bytes to hold one row of {cache}"
                    );
                }
            }
        }
    }

    /// A fixed sequence of distinct rows, appended in order (`salt` tells sequences
    /// apart).
    fn push(layer: &mut LayerKv, rows: &[(Vec<f32>, Vec<f32>)], from: usize) {
        for (t, (k, v)) in rows.iter().enumerate() {
            layer.append(k, v, from + t);
        }
    }

    fn rows(from: usize, n: usize, salt: f32, dim: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
        (from..from + n)
            .map(|t| (row(t, salt, dim), row(t, salt + 1.0, dim)))
            .collect()
    }

    /// A layer given exactly `seq` (positions from 0).
    fn given(kv: &KvConfig, seq: &[(Vec<f32>, Vec<f32>)]) -> LayerKv {
        let (kv_heads, hd) = (2usize, 8usize);
        let mut l = LayerKv::new(kv, kv_heads, hd);
        push(&mut l, seq, 0);
        l
    }

    /// Speculation inside a running hold: hold after `a` rows, append `h` rows, append a
    /// draft of `n` rows (window wraps and KIVI group completions among them for the
    /// longer drafts), rewind to `h + x`. The layer then equals the layer that appended
    /// only `a + h + x` rows and still holds those `h + x`; after `m` more appends,
    /// `released_copy(k)` and `release(k)` for `k ≤ h + x + m` (both ends, the seams) equal never having
    /// appended the dropped rows, and later appends stay equal.
    #[test]
    fn rewind_equals_never_having_appended() {
        let dim = 2 * 8;
        let shapes = [
            (4usize, 0usize, None, 0usize),
            (3, 0, None, 5),
            (4, 2, Some(7), 0),
            (4, 2, Some(7), 9),
            (5, 6, Some(5), 4),
            (2, 1, Some(1), 1),
        ];
        for kv in configs(&shapes) {
            let (w, g) = (kv.window.unwrap_or(4), kv.group_size);
            for a in [0usize, 3, 11] {
                for h in [0usize, 2, w + 1] {
                    for n in [1usize, 5, 3 * w + 2 * g] {
                        for x in [0, 1, n / 2, n] {
                            let ctx = format!("{} a={a} h={h} n={n} x={x}", ctx_of(&kv));
                            let mut seq = rows(0, a + h, 0.0, dim);
                            let draft = rows(a + h, n, 7.0, dim);
                            let mut layer = given(&kv, &seq[..a]);
                            layer.hold();
                            push(&mut layer, &seq[a..], a);
                            push(&mut layer, &draft, a + h);
                            assert_eq!(layer.held(), Some(h + n), "{ctx}");
                            layer.rewind(h + x);
                            seq.extend_from_slice(&draft[..x]);
                            assert_eq!(layer.held(), Some(h + x), "{ctx}");
                            assert_eq!(
                                snapshot(&layer),
                                snapshot(&given(&kv, &seq)),
                                "{ctx}: after rewind"
                            );
                            let m = 2 + g;
                            let more = rows(seq.len(), m, 3.0, dim);
                            push(&mut layer, &more, seq.len());
                            seq.extend_from_slice(&more);
                            assert_eq!(layer.held(), Some(h + x + m), "{ctx}");
                            assert_eq!(snapshot(&layer), snapshot(&given(&kv, &seq)), "{ctx}");
                            let top = h + x + m;
                            for k in [0, 1, h, h + x / 2, h + x, h + x + 1, top - 1, top] {
                                let want = given(&kv, &seq[..a + k]);
                                let copy = layer.released_copy(k);
                                assert_eq!(snapshot(&copy), snapshot(&want), "{ctx} k={k}");
                            }
                            let k = top / 2;
                            layer.release(k);
                            assert_eq!(layer.held(), None, "{ctx}");
                            let mut want = given(&kv, &seq[..a + k]);
                            assert_eq!(snapshot(&layer), snapshot(&want), "{ctx}: release");
                            let later = rows(a + k, 2 * w + g, 5.0, dim);
                            push(&mut layer, &later, a + k);
                            push(&mut want, &later, a + k);
                            assert_eq!(snapshot(&layer), snapshot(&want), "{ctx}: later");
                        }
                    }
                }
            }
        }
    }

    /// The server's pattern: one long hold, hundreds of draft / rewind cycles inside it
    /// (a random number of drafted rows, a random number kept, sometimes a plain row),
    /// compared after every rewind with a layer given only the kept rows; at the end,
    /// releasing at a random point equals that prefix.
    #[test]
    fn repeated_rewinds_inside_one_hold() {
        let dim = 2 * 8;
        for kv in configs(&CYCLE_SHAPES) {
            let mut rand = xorshift(0x2545_F491_4F6C_DD1Du64);
            let a = 5;
            let mut seq = rows(0, a, 0.0, dim);
            let mut layer = given(&kv, &seq);
            let mut kept = given(&kv, &seq);
            layer.hold();
            for cycle in 0..120 {
                let ctx = format!("{} cycle={cycle}", ctx_of(&kv));
                let t = seq.len();
                let n = 1 + rand(9);
                let draft = rows(t, n, 10.0 + cycle as f32 * 0.01, dim);
                push(&mut layer, &draft, t);
                let x = rand(n + 1);
                layer.rewind(t - a + x);
                push(&mut kept, &draft[..x], t);
                seq.extend_from_slice(&draft[..x]);
                assert_eq!(layer.held(), Some(seq.len() - a), "{ctx}");
                assert_eq!(snapshot(&layer), snapshot(&kept), "{ctx}: x={x} of {n}");
                if rand(2) == 0 {
                    let one = rows(seq.len(), 1, 20.0, dim);
                    push(&mut layer, &one, seq.len());
                    push(&mut kept, &one, seq.len());
                    seq.extend_from_slice(&one);
                }
            }
            let k = rand(seq.len() - a + 1);
            let copy = layer.released_copy(k);
            assert_eq!(snapshot(&copy), snapshot(&given(&kv, &seq[..a + k])));
            layer.release(k);
            assert_eq!(snapshot(&layer), snapshot(&given(&kv, &seq[..a + k])));
        }
    }

    /// Rewinding without a hold, or to at least what is held, changes nothing.
    #[test]
    fn rewind_without_effect() {
        let kv = configs(&[(4, 2, Some(6), 2)]).remove(3);
        let seq = rows(0, 9, 0.0, 16);
        let mut layer = given(&kv, &seq);
        layer.rewind(0);
        assert_eq!(layer.held(), None);
        assert_eq!(snapshot(&layer), snapshot(&given(&kv, &seq)));
        layer.hold();
        push(&mut layer, &rows(9, 3, 1.0, 16), 9);
        let before = snapshot(&layer);
        layer.rewind(3);
        layer.rewind(7);
        assert_eq!(layer.held(), Some(3));
        assert_eq!(snapshot(&layer), before);
    }
}
