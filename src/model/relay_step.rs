//! The [`Exec`] of a relay team member ([`crate::relay`]): one sequence, one token, every
//! member running the whole step program without barriers. Serial stages (norms, the
//! residual adds, the finiteness checks, the K/V append) are phases run by whichever
//! member claims them, on buffers only serial phases touch; products and attention are
//! chunked phases whose items are claimed, computed into the member's own buffers and
//! published (or taken over from a late member). The values are those of the decode team
//! and of one thread, bit for bit: every item is computed by the same serial kernels.
//!
//! A late member may still compute an attention item of layer `l` while the others have
//! gone on to later layers. What it reads does not change until the step ends: each model
//! layer has its own attention scratch (tables and score buffers,
//! `Session::relay_scratch`), and a later layer appends only to its own cache layer (a
//! layer reads its own cache or, shared, an earlier layer's). So nobody waits for it; the
//! step returns once every member has left ([`relay::run`]).

use super::team_step::{score_chunk, ProbsPtr};
use super::{
    add_output, check_finite_hidden, check_finite_kv, glu, head_norm, soft_cap, Exec, Input, Kv,
    Model, Session, StepBufs,
};
use crate::attention::{
    append_kv, attend_heads, mix_query_heads, prepare_step, probs_mut, score_rows, size_probs,
    AttnScratch, AttnSplit, HeadScratch, StepTables,
};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::LayerKv;
use crate::ops::matvec::{quantized_forms, row_part, row_parts, rows_into};
use crate::ops::{self, Matrix};
use crate::relay::{self, Part, Relay, Seat};
use crate::team::{SharedCell, SharedSlice};
use crate::wkernels::{ActsForms, QuantizedActs};
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
    if s.relay_scratch.len() != c.n_layers {
        s.relay_scratch = vec![AttnScratch::new(c, s.cache.config()); c.n_layers];
    }
    let (tables, heads): (Vec<_>, Vec<_>) = s
        .relay_scratch
        .iter_mut()
        .map(AttnScratch::split_mut)
        .map(|(t, h)| (SharedCell::new(t), SharedSlice::new(h)))
        .unzip();
    let mut head_probs = vec![ProbsPtr(std::ptr::null_mut(), 0); c.n_layers * c.n_kv_heads];
    let error = Mutex::new(None);
    // At most: a product's parts (4 per member), a split attention's scoring units (about
    // 4 per member, plus one per KV head for rounding), or its query-head units.
    let items = 4 * n + c.n_kv_heads + c.n_heads;
    let width = c.hidden_size.max(c.q_dim()).max(c.intermediate_size);
    let relay = Relay::new(items, width);
    let shared = RelayBufs {
        x: SharedSlice::new(&mut bufs.x),
        h: SharedSlice::new(&mut bufs.h),
        q: SharedSlice::new(&mut bufs.q),
        k: SharedSlice::new(&mut bufs.k),
        v: SharedSlice::new(&mut bufs.v),
        proj: SharedSlice::new(&mut bufs.proj),
        logits: SharedSlice::new(&mut s.logits),
        layers: SharedSlice::new(s.cache.layers_mut()),
        tables,
        heads,
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
            pending_add: None,
            pending_check: None,
            pending_norms: None,
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
/// their product), and write a layer's cache, tables and scores' sizes, in that layer's
/// append phase; chunked phases write only the rows of an item whose claim stands
/// (publishing), and read a layer's cache, tables and scores after its append phase
/// (late members: until the step ends; no phase of a later layer writes them).
struct RelayBufs<'a> {
    x: SharedSlice<'a, f32>,
    h: SharedSlice<'a, f32>,
    q: SharedSlice<'a, f32>,
    k: SharedSlice<'a, f32>,
    v: SharedSlice<'a, f32>,
    proj: SharedSlice<'a, f32>,
    logits: SharedSlice<'a, f32>,
    /// the cache's layers
    layers: SharedSlice<'a, LayerKv>,
    /// per model layer: its attention tables and its KV heads' scratch
    tables: Vec<SharedCell<'a, StepTables>>,
    heads: Vec<SharedSlice<'a, HeadScratch>>,
    /// `(layer, KV head)`: where the head's scores are
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
    /// `x += post_norm(proj)` of the last residual, run by the next serial phase (a norm):
    /// the post norm (of the model, which outlives the step) and its epsilon
    pending_add: Option<(*const Option<Vec<f32>>, f32)>,
    /// the layer whose K/V the next serial phase (the append) checks first
    pending_check: Option<usize>,
    /// the per-head q and k norms (the model's) it applies next, and their epsilon
    pending_norms: Option<NormsPtr>,
}

/// Pointers to a layer's per-head q and k norm weights, and their epsilon.
type NormsPtr = (*const Option<Vec<f32>>, *const Option<Vec<f32>>, f32);

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
    /// being what was sent to input buffer `buf`.
    fn product(
        &mut self,
        mats: &[&Matrix],
        buf: usize,
        outs: &[(&SharedSlice<f32>, &Option<Vec<f32>>)],
        cap: Option<f32>,
    ) {
        let parts = row_parts(mats, self.seat.n);
        let forms = quantized_forms(mats);
        let (acts, out, pieces) = (&mut self.acts, &mut self.out, &mut self.pieces);
        let mut quantized = false;
        self.seat
            .chunks(parts, Some((buf, mats[0].cols)), |k, part, x| match part {
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

    /// A serial phase: the last residual's add, then `h = rmsnorm(x) · w`, checked by
    /// `check` (a failure fails the step), sent to the next product (input buffer 0).
    fn norm_and_send(
        &mut self,
        w: &[f32],
        eps: f32,
        check: impl FnOnce(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let (b, add) = (self.b, self.pending_add.take());
        let done = self.seat.solo(|seat| {
            // SAFETY: serial phases run one at a time and alone touch `x`, `h` and (after
            // its product) `proj`; the post norm is the model's, which outlives the step.
            let (x, h) = unsafe { (b.x.range_mut(0..b.x.len()), b.h.range_mut(0..b.h.len())) };
            if let Some((post_norm, add_eps)) = add {
                add_output(x, unsafe { b.proj.all() }, unsafe { &*post_norm }, add_eps);
            }
            ops::rmsnorm(x, w, eps, h);
            let r = check(h);
            match r.is_err() {
                true => seat.fail(),
                false => seat.sender().send(0, 0, h),
            }
            r
        });
        done.unwrap_or(Ok(()))
    }
}

impl Exec for RelayMember<'_, '_, '_> {
    fn norm(&mut self, w: &[f32], eps: f32) {
        let _ = self.norm_and_send(w, eps, |_| Ok(()));
    }

    fn project(&mut self, mats: &[&Matrix], biases: [&Option<Vec<f32>>; 3]) {
        let b = self.b;
        let outs = [(&b.q, biases[0]), (&b.k, biases[1]), (&b.v, biases[2])];
        self.product(mats, 0, &outs[..mats.len()], None);
    }

    /// Deferred to the append's serial phase ([`Exec::attend`]), which checks first.
    fn check_kv(&mut self, l: usize) -> Result<()> {
        self.pending_check = Some(l);
        Ok(())
    }

    /// Deferred to the append's serial phase ([`Exec::attend`]), after the check.
    fn head_norms(&mut self, q_norm: &Option<Vec<f32>>, k_norm: &Option<Vec<f32>>, eps: f32) {
        self.pending_norms = Some((q_norm as *const _, k_norm as *const _, eps));
    }

    /// A serial phase appends the K/V (`Kv::Own`) and prepares layer `l`'s tables (its
    /// own: a late member may still read an earlier layer's); then two chunked phases:
    /// whole KV heads (and an empty one), or, split ([`AttnSplit`]), the scores of row
    /// ranges, then the softmax and weighted sum per run of query heads.
    fn attend(&mut self, model: &Model, l: usize, kv: Kv) -> Result<()> {
        let (c, rope, b, pos, members) =
            (&model.cfg, &model.ropes[l], self.b, self.pos, self.seat.n);
        let src = match kv {
            Kv::Own => l,
            Kv::Shared(src) => src,
        };
        let (check, norms) = (self.pending_check.take(), self.pending_norms.take());
        let appended = self.seat.solo(|seat| {
            if let Some(l) = check {
                // SAFETY: serial; `k`/`v` are complete and only serial phases touch them.
                let (k, v) = unsafe { (b.k.all(), b.v.all()) };
                if let Err(e) = check_finite_kv(k, v, l, pos) {
                    seat.fail();
                    return Err(e);
                }
            }
            if let Some((q_norm, k_norm, eps)) = norms {
                // SAFETY: serial, as above; the norms are the model's, which outlives the
                // step.
                let (q, k) = unsafe { (b.q.range_mut(0..b.q.len()), b.k.range_mut(0..b.k.len())) };
                head_norm(q, unsafe { &*q_norm }, eps);
                head_norm(k, unsafe { &*k_norm }, eps);
            }
            // SAFETY: serial; nobody reads layer `l`'s tables and scores, nor (`Kv::Own`)
            // its cache layer, before this phase ends (later layers' phases read their
            // own, earlier ones' read earlier layers); q/k/v are only read.
            let tables = unsafe { b.tables[l].get_mut() };
            let (q, k, v) = unsafe { (b.q.all(), b.k.all(), b.v.all()) };
            if let Kv::Own = kv {
                let layer = unsafe { &mut b.layers.range_mut(l..l + 1)[0] };
                append_kv(c, rope, layer, k, v, pos, tables);
            }
            // SAFETY: read only, here and by this layer's items; `src <= l`, and no phase
            // of the step writes a cache layer after its own append phase.
            let layer = unsafe { b.layers.get(src) };
            prepare_step(c, rope, layer, q, pos, tables);
            let n = layer.len();
            let split = b.split.splits(c.n_kv_heads, members, n);
            if split {
                // SAFETY: as above, layer `l`'s scores.
                let (heads, ptrs) = unsafe {
                    (
                        b.heads[l].range_mut(0..b.heads[l].len()),
                        b.head_probs
                            .range_mut(l * c.n_kv_heads..(l + 1) * c.n_kv_heads),
                    )
                };
                size_probs(heads, c.group(), n);
                for (p, hs) in ptrs.iter_mut().zip(heads) {
                    let probs = probs_mut(hs);
                    *p = ProbsPtr(probs.as_mut_ptr(), probs.len());
                }
            }
            b.rows.store(n, Ordering::Release);
            b.splits.store(split, Ordering::Release);
            Ok(())
        });
        appended.unwrap_or(Ok(()))?;
        // Read after this member saw the serial phase end: this layer's plan, or a later
        // one's if this member is late (stored after the phases below ended, which then
        // see it and are skipped).
        let n = b.rows.load(Ordering::Acquire);
        let split = b.splits.load(Ordering::Acquire);
        let (hd, group, nkv) = (c.head_dim, c.group(), c.n_kv_heads);
        let (hs, out, probs) = (&mut self.attn, &mut self.out, &mut self.probs);
        // Attention's output goes to input buffer 1: `o_proj`'s input.
        let tx = self.seat.sender();
        // SAFETY (of every cache, tables and scores access below): layer `l`'s phases run
        // after its append phase, and nothing writes what they read until the step ends
        // (the module notes), also for a late member.
        let layer = unsafe { b.layers.get(src) };
        let tables = unsafe { b.tables[l].get() };
        // Where layer `l`'s KV head `h` keeps its scores (set by the append phase).
        let scores_at = |h: usize| unsafe { b.head_probs.get(l * nkv + h) }.0;
        if !split {
            let width = group * hd;
            self.seat.chunks(nkv, None, |h, part, _| match part {
                Part::Compute => {
                    out.resize(width, 0.0);
                    attend_heads(c, rope, layer, tables, h, std::slice::from_mut(hs), out);
                }
                Part::Publish => tx.send(1, h * width, &out[..width]),
            });
            // The split's second phase, empty: every member counts the same phases.
            self.seat.chunks(0, None, |_, _, _| {});
            return Ok(());
        }
        let chunk = score_chunk(n, members, nkv);
        let per_head = n.div_ceil(chunk);
        self.seat.chunks(nkv * per_head, None, |u, part, _| {
            let (h, k) = (u / per_head, u % per_head);
            let rows = k * chunk..((k + 1) * chunk).min(n);
            let len = rows.len();
            match part {
                Part::Compute => {
                    out.resize(group * len, 0.0);
                    score_rows(c, rope, layer, tables, h, rows, hs, out, len);
                }
                Part::Publish => {
                    for (j, s) in out[..group * len].chunks_exact(len).enumerate() {
                        let at = j * n + rows.start;
                        // SAFETY: sized `group * n` by the serial phase; the claim
                        // stands, so this member alone writes these scores.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(scores_at(h).add(at), len) };
                        dst.copy_from_slice(s);
                    }
                }
            }
        });
        let per = (group / members).max(1);
        let units = group.div_ceil(per);
        self.seat.chunks(nkv * units, None, |u, part, _| {
            let (h, j0) = (u / units, (u % units) * per);
            let j1 = (j0 + per).min(group);
            let (q0, q1) = (h * group + j0, h * group + j1);
            match part {
                Part::Compute => {
                    // SAFETY: every score was published in the previous phase; only read.
                    let scores = unsafe {
                        std::slice::from_raw_parts(scores_at(h).add(j0 * n), (j1 - j0) * n)
                    };
                    probs.clear();
                    probs.extend_from_slice(scores);
                    out.resize((q1 - q0) * hd, 0.0);
                    mix_query_heads(c, rope, layer, tables, h, probs, out);
                }
                Part::Publish => tx.send(1, q0 * hd, &out[..(q1 - q0) * hd]),
            }
        });
        Ok(())
    }

    /// The product of what attention or the GLU published (input buffer 1) into `proj`;
    /// the next serial phase (a norm) adds it to `x`.
    fn residual(&mut self, w: &Matrix, _input: Input, post_norm: &Option<Vec<f32>>, eps: f32) {
        let b = self.b;
        self.product(&[w], 1, &[(&b.proj, &None)], None);
        self.pending_add = Some((post_norm as *const _, eps));
    }

    /// Gate and up on the same rows, the GLU on the item's rows.
    fn gated(&mut self, c: &Config, w_gate: &Matrix, w_up: &Matrix) {
        let pair = [w_gate, w_up];
        let parts = row_parts(&pair[..1], self.seat.n);
        let forms = quantized_forms(&pair);
        let (acts, out, up, pieces) = (
            &mut self.acts,
            &mut self.out,
            &mut self.up,
            &mut self.pieces,
        );
        let tx = self.seat.sender();
        let mut quantized = false;
        self.seat
            .chunks(parts, Some((0, w_gate.cols)), |k, part, x| match part {
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
                        // `down_proj`'s input.
                        tx.send(1, r.start, &out[..r.len()]);
                    }
                }
            });
    }

    fn logits(&mut self, norm: &[f32], eps: f32, lm_head: &Matrix, cap: Option<f32>) -> Result<()> {
        let pos = self.pos;
        self.norm_and_send(norm, eps, |h| check_finite_hidden(h, pos))?;
        let b = self.b;
        self.product(&[lm_head], 0, &[(&b.logits, &None)], cap);
        Ok(())
    }
}
