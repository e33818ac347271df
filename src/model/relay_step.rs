//! The [`Exec`] of a relay team member ([`crate::relay`]): one sequence, one token, every
//! member running the whole step program without barriers. Serial stages (norms, the
//! residual adds, the finiteness checks, the K/V append) are phases run by whichever
//! member claims them, on buffers only serial phases touch; products and attention are
//! chunked phases whose items are claimed, computed into the member's own buffers and
//! published (or taken over from a late member). The values are those of the decode team
//! and of one thread, bit for bit: every item is computed by the same serial kernels.

use super::team_step::{score_chunk, ProbsPtr};
use super::{
    add_output, check_finite_hidden, check_finite_kv, glu, head_norm, soft_cap, Exec, Input, Kv,
    Model, Session, StepBufs,
};
use crate::attention::{
    append_kv, attend_heads, mix_query_heads, prepare_step, probs_mut, score_rows, size_probs,
    AttnSplit, HeadScratch, StepTables,
};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::ops::matvec::{quantized_forms, row_part, row_parts, rows_into};
use crate::ops::qdot::{ActsForms, QuantizedActs};
use crate::ops::{self, Matrix};
use crate::relay::{self, Part, Relay, Seat};
use crate::team::{SharedCell, SharedSlice};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Whether a step of `s` can run as a relay: not when an eviction policy observes
/// attention's weights or the session records them (both read every head's weights after
/// the attention, which a relay member keeps only for the items it computed).
pub(super) fn supports(s: &Session) -> bool {
    !s.record_probs && !(0..s.cache.n_layers()).any(|l| s.cache.layer(l).observes())
}

/// [`Model::forward`] as a relay of `n` members. `None` (and the session unchanged but
/// for scratch) when the relay's helper threads are busy with another step: the caller
/// runs the step another way.
pub(super) fn run_step(
    model: &Model,
    s: &mut Session,
    token: u32,
    pos: usize,
    n: usize,
) -> Option<Result<()>> {
    let c = &model.cfg;
    let mut bufs = StepBufs::reuse(std::mem::take(&mut s.bufs), c, 1);
    model.embed_row(token, &mut bufs.x);
    let (tables, heads) = s.scratch.split_mut();
    let mut head_probs = vec![ProbsPtr(std::ptr::null_mut(), 0); heads.len()];
    let error = Mutex::new(None);
    // At most: a product's parts (4 per member), a split attention's scoring units (about
    // 4 per member, plus one per KV head for rounding), or its query-head units.
    let items = 4 * n + c.n_kv_heads + c.n_heads;
    let width = c.hidden_size.max(c.q_dim()).max(c.intermediate_size);
    let relay = Relay::new(n, items, width);
    let shared = RelayBufs {
        x: SharedSlice::new(&mut bufs.x),
        h: SharedSlice::new(&mut bufs.h),
        q: SharedSlice::new(&mut bufs.q),
        k: SharedSlice::new(&mut bufs.k),
        v: SharedSlice::new(&mut bufs.v),
        att: SharedSlice::new(&mut bufs.att),
        proj: SharedSlice::new(&mut bufs.proj),
        gate: SharedSlice::new(&mut bufs.gate),
        logits: SharedSlice::new(&mut s.logits),
        cache: SharedCell::new(&mut s.cache),
        tables: SharedCell::new(tables),
        heads: SharedSlice::new(heads),
        head_probs: SharedSlice::new(&mut head_probs),
        split: s.attn_split,
        rows: AtomicUsize::new(0),
        splits: AtomicBool::new(false),
    };
    let ran = relay::run(n, &relay, &|id| {
        let mut member = RelayMember {
            seat: Seat::new(&relay, id, n),
            b: &shared,
            pos,
            acts: QuantizedActs::default(),
            out: Vec::new(),
            up: Vec::new(),
            pieces: Vec::new(),
            attn: HeadScratch::default(),
            probs: Vec::new(),
        };
        if let Err(e) = model.step(&mut member) {
            let mut slot = error.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(e);
        }
    });
    s.bufs = bufs;
    ran?;
    let failed = error.into_inner().unwrap_or_else(|e| e.into_inner());
    Some(match failed {
        Some(e) => Err(e),
        None if relay.failed() => Err(Error::Generate("a relay team step failed".into())),
        None => Ok(()),
    })
}

/// The buffers of one relay step. Serial phases alone touch `x`, `h`, `q`/`k`/`v` (after
/// their product), the cache, the tables and the heads' scratch sizes; chunked phases
/// write only the rows of an item whose claim stands (publishing), and read the cache,
/// the tables and the heads' scores only under their reading flag.
struct RelayBufs<'a> {
    x: SharedSlice<'a, f32>,
    h: SharedSlice<'a, f32>,
    q: SharedSlice<'a, f32>,
    k: SharedSlice<'a, f32>,
    v: SharedSlice<'a, f32>,
    att: SharedSlice<'a, f32>,
    proj: SharedSlice<'a, f32>,
    gate: SharedSlice<'a, f32>,
    logits: SharedSlice<'a, f32>,
    cache: SharedCell<'a, KvCache>,
    tables: SharedCell<'a, StepTables>,
    heads: SharedSlice<'a, HeadScratch>,
    head_probs: SharedSlice<'a, ProbsPtr>,
    split: AttnSplit,
    /// the rows the current layer's attention reads, and whether it is split (set by the
    /// serial phase that prepares it)
    rows: AtomicUsize,
    splits: AtomicBool,
}

struct RelayMember<'r, 'b, 'a> {
    seat: Seat<'r>,
    b: &'b RelayBufs<'a>,
    pos: usize,
    acts: QuantizedActs,
    /// the claimed item's result
    out: Vec<f32>,
    /// the claimed item's `up` rows (the GLU)
    up: Vec<f32>,
    /// `(matrix, rows)` of the claimed item's pieces in `out`
    pieces: Vec<(usize, Range<usize>)>,
    attn: HeadScratch,
    /// a copy of a query-head unit's scores (the softmax runs on it in place)
    probs: Vec<f32>,
}

/// The phase's input `x` in the quantised forms `forms` (if any), quantised on the
/// member's first item of the phase (`done`).
fn quantized_once<'a>(
    acts: &'a mut QuantizedActs,
    x: &[f32],
    forms: ActsForms,
    done: &mut bool,
) -> Option<&'a QuantizedActs> {
    if forms.any() && !*done {
        acts.quantize_forms(x, forms);
        *done = true;
    }
    forms.any().then_some(&*acts)
}

impl RelayMember<'_, '_, '_> {
    /// `outs[i] = mats[i] · input` (plus bias, soft-capped when `cap` is given), the input
    /// being what the previous serial phase sent.
    fn product(
        &mut self,
        mats: &[&Matrix],
        outs: &[(&SharedSlice<f32>, &Option<Vec<f32>>)],
        cap: Option<f32>,
    ) {
        let parts = row_parts(mats, self.seat.n);
        let forms = quantized_forms(mats);
        let (acts, out, pieces) = (&mut self.acts, &mut self.out, &mut self.pieces);
        let mut quantized = false;
        self.seat
            .chunks(parts, mats[0].cols, false, |k, part, x| match part {
                Part::Compute => {
                    let q = quantized_once(acts, x, forms, &mut quantized);
                    out.clear();
                    pieces.clear();
                    row_part(mats, k, parts, |i, r| {
                        let at = out.len();
                        out.resize(at + r.len(), 0.0);
                        rows_into(mats[i], x, q, r.start, &mut out[at..]);
                        pieces.push((i, r));
                    });
                }
                Part::Publish => {
                    let mut at = 0;
                    for (i, r) in pieces.iter() {
                        // SAFETY: this member's claim of the item stands, so it alone writes
                        // these rows in this phase; they are read after the phase.
                        let o = unsafe { outs[*i].0.range_mut(r.clone()) };
                        o.copy_from_slice(&out[at..at + r.len()]);
                        at += r.len();
                        if let Some(bias) = outs[*i].1 {
                            ops::add_assign(o, &bias[r.clone()]);
                        }
                        soft_cap(o, cap);
                    }
                }
            });
    }

    /// A serial phase sending `h = rmsnorm(x) · w` to the next product.
    fn norm_and_send(&mut self, w: &[f32], eps: f32) {
        let b = self.b;
        self.seat.solo(|seat| {
            // SAFETY: serial phases run one at a time and alone touch `x` and `h`.
            let (x, h) = unsafe { (b.x.all(), b.h.range_mut(0..b.h.len())) };
            ops::rmsnorm(x, w, eps, h);
            seat.put_input(h);
        });
    }
}

impl Exec for RelayMember<'_, '_, '_> {
    fn norm(&mut self, w: &[f32], eps: f32) {
        self.norm_and_send(w, eps);
    }

    fn project(&mut self, mats: &[&Matrix], biases: [&Option<Vec<f32>>; 3]) {
        let b = self.b;
        let outs = [(&b.q, biases[0]), (&b.k, biases[1]), (&b.v, biases[2])];
        self.product(mats, &outs[..mats.len()], None);
    }

    fn check_kv(&mut self, l: usize) -> Result<()> {
        let (b, pos) = (self.b, self.pos);
        let checked = self.seat.solo(|seat| {
            // SAFETY: `k`/`v` are complete (their product's phase has ended) and only
            // serial phases touch them until the next layer's product.
            let (k, v) = unsafe { (b.k.all(), b.v.all()) };
            let r = check_finite_kv(k, v, l, pos);
            if r.is_err() {
                seat.fail();
            }
            r
        });
        checked.unwrap_or(Ok(()))
    }

    fn head_norms(&mut self, q_norm: &Option<Vec<f32>>, k_norm: &Option<Vec<f32>>, eps: f32) {
        if q_norm.is_none() && k_norm.is_none() {
            return;
        }
        let b = self.b;
        self.seat.solo(|_| {
            // SAFETY: as in `check_kv`.
            let (q, k) = unsafe { (b.q.range_mut(0..b.q.len()), b.k.range_mut(0..b.k.len())) };
            head_norm(q, q_norm, eps);
            head_norm(k, k_norm, eps);
        });
    }

    /// A serial phase appends the K/V (`Kv::Own`) and prepares the step, once no member
    /// still reads the cache for an earlier layer; then two chunked phases: whole KV heads
    /// (and an empty one), or, split ([`AttnSplit`]), the scores of row ranges, then the
    /// softmax and weighted sum per run of query heads.
    fn attend(&mut self, model: &Model, l: usize, kv: Kv) -> Result<()> {
        let (c, rope, b, pos, members) =
            (&model.cfg, &model.ropes[l], self.b, self.pos, self.seat.n);
        let src = match kv {
            Kv::Own => l,
            Kv::Shared(src) => src,
        };
        self.seat.solo(|seat| {
            seat.wait_readers();
            // SAFETY: serial; no member reads the cache, the tables or the heads' scratch
            // (`wait_readers`), and q/k/v are only read.
            let (cache, tables) = unsafe { (b.cache.get_mut(), b.tables.get_mut()) };
            let (q, k, v) = unsafe { (b.q.all(), b.k.all(), b.v.all()) };
            if let Kv::Own = kv {
                append_kv(c, rope, cache.layer_mut(l), k, v, pos, tables);
            }
            prepare_step(c, rope, cache.layer(src), q, pos, tables);
            let n = cache.layer(src).len();
            let split = b.split.splits(c.n_kv_heads, members, n);
            if split {
                // SAFETY: as above.
                let (heads, ptrs) = unsafe {
                    (
                        b.heads.range_mut(0..b.heads.len()),
                        b.head_probs.range_mut(0..b.head_probs.len()),
                    )
                };
                size_probs(heads, c.group(), n);
                for (p, hs) in ptrs.iter_mut().zip(heads) {
                    let probs = probs_mut(hs);
                    *p = ProbsPtr(probs.as_mut_ptr(), probs.len());
                }
            }
            b.rows.store(n, Ordering::Relaxed);
            b.splits.store(split, Ordering::Relaxed);
        });
        // Read after this member saw the serial phase end: this layer's plan, or a later
        // one's if this member is late (then its phases below are skipped).
        let n = b.rows.load(Ordering::Relaxed);
        let split = b.splits.load(Ordering::Relaxed);
        let (hd, group, nkv) = (c.head_dim, c.group(), c.n_kv_heads);
        let (hs, out, probs) = (&mut self.attn, &mut self.out, &mut self.probs);
        // SAFETY (of every cache, tables and scores access below): the work runs only in
        // the current phase under this member's reading flag, and nothing changes those
        // until no member reads (`wait_readers`).
        if !split {
            let width = group * hd;
            self.seat.chunks(nkv, 0, true, |h, part, _| match part {
                Part::Compute => {
                    let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
                    out.resize(width, 0.0);
                    attend_heads(
                        c,
                        rope,
                        cache.layer(src),
                        tables,
                        h,
                        std::slice::from_mut(hs),
                        out,
                    );
                }
                // SAFETY: the claim stands: these rows of `att` are this member's alone.
                Part::Publish => unsafe { b.att.range_mut(h * width..(h + 1) * width) }
                    .copy_from_slice(&out[..width]),
            });
            // The split's second phase, empty: every member counts the same phases.
            self.seat.chunks(0, 0, false, |_, _, _| {});
            return Ok(());
        }
        let chunk = score_chunk(n, members, nkv);
        let per_head = n.div_ceil(chunk);
        self.seat.chunks(nkv * per_head, 0, true, |u, part, _| {
            let (h, k) = (u / per_head, u % per_head);
            let rows = k * chunk..((k + 1) * chunk).min(n);
            let len = rows.len();
            match part {
                Part::Compute => {
                    let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
                    out.resize(group * len, 0.0);
                    score_rows(c, rope, cache.layer(src), tables, h, rows, hs, out, len);
                }
                Part::Publish => {
                    let ptrs = unsafe { b.head_probs.all() };
                    for (j, s) in out[..group * len].chunks_exact(len).enumerate() {
                        let at = j * n + rows.start;
                        // SAFETY: sized `group * n` by the serial phase; the claim
                        // stands, so this member alone writes these scores.
                        let dst = unsafe { std::slice::from_raw_parts_mut(ptrs[h].0.add(at), len) };
                        dst.copy_from_slice(s);
                    }
                }
            }
        });
        let per = (group / members).max(1);
        let units = group.div_ceil(per);
        self.seat.chunks(nkv * units, 0, true, |u, part, _| {
            let (h, j0) = (u / units, (u % units) * per);
            let j1 = (j0 + per).min(group);
            let (q0, q1) = (h * group + j0, h * group + j1);
            match part {
                Part::Compute => {
                    let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
                    let ptrs = unsafe { b.head_probs.all() };
                    // SAFETY: every score was published in the previous phase; only read.
                    let scores =
                        unsafe { std::slice::from_raw_parts(ptrs[h].0.add(j0 * n), (j1 - j0) * n) };
                    probs.clear();
                    probs.extend_from_slice(scores);
                    out.resize((q1 - q0) * hd, 0.0);
                    mix_query_heads(c, rope, cache.layer(src), tables, h, probs, out);
                }
                // SAFETY: the claim stands: these rows of `att` are this member's alone.
                Part::Publish => unsafe { b.att.range_mut(q0 * hd..q1 * hd) }
                    .copy_from_slice(&out[..(q1 - q0) * hd]),
            }
        });
        Ok(())
    }

    /// A serial phase sends the input; the product into `proj`; a serial phase adds it.
    fn residual(&mut self, w: &Matrix, input: Input, post_norm: &Option<Vec<f32>>, eps: f32) {
        let b = self.b;
        self.seat.solo(|seat| {
            // SAFETY: complete (its phase has ended); written again only in a later layer.
            let v = unsafe {
                match input {
                    Input::Att => b.att.all(),
                    Input::Gate => b.gate.all(),
                }
            };
            seat.put_input(v);
        });
        self.product(&[w], &[(&b.proj, &None)], None);
        self.seat.solo(|_| {
            // SAFETY: serial; `proj` is complete.
            let (x, proj) = unsafe { (b.x.range_mut(0..b.x.len()), b.proj.all()) };
            add_output(x, proj, post_norm, eps);
        });
    }

    /// Gate and up on the same rows, the GLU on the item's rows.
    fn gated(&mut self, c: &Config, w_gate: &Matrix, w_up: &Matrix) {
        let b = self.b;
        let pair = [w_gate, w_up];
        let parts = row_parts(&pair[..1], self.seat.n);
        let forms = quantized_forms(&pair);
        let (acts, out, up, pieces) = (
            &mut self.acts,
            &mut self.out,
            &mut self.up,
            &mut self.pieces,
        );
        let mut quantized = false;
        self.seat
            .chunks(parts, w_gate.cols, false, |k, part, x| match part {
                Part::Compute => {
                    let q = quantized_once(acts, x, forms, &mut quantized);
                    pieces.clear();
                    row_part(&pair[..1], k, parts, |_, r| {
                        out.resize(r.len(), 0.0);
                        up.resize(r.len(), 0.0);
                        rows_into(w_gate, x, q, r.start, out);
                        rows_into(w_up, x, q, r.start, up);
                        // Parts start on multiples of 8 rows: the same 8-lane chunks as a
                        // whole vector's GLU.
                        glu(c, out, up);
                        pieces.push((0, r));
                    });
                }
                Part::Publish => {
                    for (_, r) in pieces.iter() {
                        // SAFETY: the claim stands: these rows are this member's alone.
                        unsafe { b.gate.range_mut(r.clone()) }.copy_from_slice(&out[..r.len()]);
                    }
                }
            });
    }

    fn logits(&mut self, norm: &[f32], eps: f32, lm_head: &Matrix, cap: Option<f32>) -> Result<()> {
        let (b, pos) = (self.b, self.pos);
        let checked = self.seat.solo(|seat| {
            // SAFETY: serial phases alone touch `x` and `h`.
            let (x, h) = unsafe { (b.x.all(), b.h.range_mut(0..b.h.len())) };
            ops::rmsnorm(x, norm, eps, h);
            let r = check_finite_hidden(h, pos);
            match r.is_err() {
                true => seat.fail(),
                false => seat.put_input(h),
            }
            r
        });
        checked.unwrap_or(Ok(()))?;
        self.product(&[lm_head], &[(&b.logits, &None)], cap);
        Ok(())
    }
}
