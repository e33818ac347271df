//! The [`Exec`] of a decode team member ([`crate::relay`]): one sequence, one token, every
//! member running the whole step program without barriers. Serial stages (norms, the
//! residual adds, the finiteness checks, the K/V append and attention's preparation) are
//! serial phases, run by whichever member claims them on the step's [`SerialState`];
//! products and attention are chunked phases whose items are claimed, computed into the
//! member's own buffers and published (or taken over from a late member) into the step's
//! boards ([`Board`]) and input buffers. The values are those of one thread bit for bit,
//! the attention weights a session records (`Session::record_probs`) included: every item
//! is computed by the same serial kernels.
//!
//! Who writes what (everything else is only read): serial phases the residual stream, the
//! cache (each layer at its append, through a unique borrow taken in layer order) and each
//! layer's attention tables, which they then hand to that layer's items by a shared borrow
//! for the rest of the step, with the layer's split and score layout ([`View`], set once per
//! layer); items their ranges of the boards (q/k/v, a block's output and the logits, which
//! serial phases read; a split attention's scores, which the next phase's items read; the
//! recorded weights) and the two input buffers. A late member may still compute an
//! attention item of layer `l` while the others have gone on: all it reads is layer `l`'s
//! view, which nothing changes until the step ends, and a later layer appends only to its
//! own cache layer (a layer reads its own cache or, shared, an earlier layer's). So nobody
//! waits for it; the step returns once every member has left ([`relay::run`]).

use super::{
    add_output, check_finite_hidden, check_finite_kv, glu, head_norm, soft_cap, Exec, Input, Kv,
    Model, Session,
};
use crate::attention::{
    append_kv, attend_heads, mix_query_heads, prepare_step, score_rows, AttnSplit, HeadScratch,
    SplitPlan, StepTables,
};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kivi::KvKernel;
use crate::kv_cache::LayerKv;
use crate::ops::matvec::{quantized_forms, row_part, row_parts, rows_into};
use crate::ops::{self, Matrix};
use crate::relay::{self, Board, Part, Phase, Relay, Seat, Serial};
use crate::wkernels::{ActsForms, QuantizedActs};
use std::iter::Enumerate;
use std::ops::Range;
use std::slice::IterMut;
use std::sync::OnceLock;

/// Whether a step of `s` can run as a team of `members`: not when an eviction policy
/// observes attention's weights (it would change the cache layer a late member may still
/// read), nor with more members than a relay has room for ([`relay::MAX_MEMBERS`]).
pub(super) fn supports(s: &Session, members: usize) -> bool {
    members <= relay::MAX_MEMBERS && !(0..s.cache.n_layers()).any(|l| s.cache.layer(l).observes())
}

/// What a session keeps for its team steps: the serial phases' buffers, the boards'
/// buffers and cuts, and each model layer's attention tables and scores (a layer's own, so
/// that preparing it never waits for a late member still reading an earlier layer's).
#[derive(Default)]
pub(super) struct RelayScratch {
    /// the team size the cuts were made for (0: none yet)
    members: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    normed: Vec<f32>,
    q_normed: Vec<f32>,
    k_normed: Vec<f32>,
    /// `q | k | v` of a layer with its own K/V
    qkv: Vec<f32>,
    /// `q` of a shared layer
    q: Vec<f32>,
    /// a block's output (`o_proj`, `down_proj`)
    proj: Vec<f32>,
    /// the items' ranges of each product's board: `qkv`, `q`, `proj`, the logits
    cuts: [Vec<usize>; 4],
    layers: Vec<LayerScratch>,
}

/// One model layer's attention state in a team step.
struct LayerScratch {
    tables: StepTables,
    /// a split attention's scores, laid out by [`SplitPlan::score_at`]
    scores: Vec<f32>,
    score_cuts: Vec<usize>,
    /// the recorded weights' cuts, one range per attention item
    weight_cuts: Vec<usize>,
}

impl RelayScratch {
    /// Sizes everything for `model` on a team of `members` (again only when that changes),
    /// the step tables on the session's KIVI kernel variant `kv_kernel` (fixed for a
    /// session).
    fn prepare(&mut self, model: &Model, members: usize, kv_kernel: KvKernel) {
        if self.members == members {
            return;
        }
        let c = &model.cfg;
        let (hd, qd, kvd) = (c.hidden_size, c.q_dim(), c.kv_dim());
        self.x = vec![0.0; hd];
        self.h = vec![0.0; hd];
        self.qkv = vec![0.0; qd + 2 * kvd];
        self.q = vec![0.0; qd];
        self.proj = vec![0.0; hd];
        // Every layer's matrices have the config's shapes (checked at load), so the cuts of
        // layer 0's (there is one: the config has at least one layer) serve them all; a
        // shared layer projects `q` alone.
        let first = &model.layers[0];
        let qkv: Vec<&Matrix> = [Some(&first.wq), first.wk.as_ref(), first.wv.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        let products: [&[&Matrix]; 4] = [&qkv, &[&first.wq], &[&first.wo], &[&model.lm_head]];
        for (cuts, mats) in self.cuts.iter_mut().zip(products) {
            part_cuts(mats, members, cuts);
        }
        self.layers = (0..c.n_layers)
            .map(|_| LayerScratch {
                tables: StepTables::new(c, kv_kernel),
                scores: Vec::new(),
                score_cuts: Vec::new(),
                weight_cuts: Vec::new(),
            })
            .collect();
        self.members = members;
    }
}

/// Where the parts of a product of `mats` on `members` ([`row_part`]) lie in its output
/// (the matrices' rows one after the other): part `k` is `cuts[k]..cuts[k + 1]`.
fn part_cuts(mats: &[&Matrix], members: usize, cuts: &mut Vec<usize>) {
    let parts = row_parts(mats, members);
    let starts: Vec<usize> = mats
        .iter()
        .scan(0, |at, m| {
            let start = *at;
            *at += m.rows;
            Some(start)
        })
        .collect();
    cuts.clear();
    cuts.push(0);
    for k in 0..parts {
        let mut end = cuts[k];
        row_part(mats, k, parts, |i, r| end = starts[i] + r.end);
        cuts.push(end);
    }
}

/// [`Model::forward`] as a team of `n` members. `None` (nothing ran, the session unchanged
/// but for scratch) when the team's helper threads cannot be started: the caller runs the
/// step another way. The caller has checked `token`.
pub(super) fn run_step(
    model: &Model,
    s: &mut Session,
    token: u32,
    pos: usize,
    n: usize,
) -> Option<Result<()>> {
    let c = &model.cfg;
    s.relay.prepare(model, n, s.scratch.kv_kernel());
    let RelayScratch {
        x,
        h,
        normed,
        q_normed,
        k_normed,
        qkv,
        q,
        proj,
        cuts,
        layers,
        ..
    } = &mut s.relay;
    model.embed_row(token, x);
    let serial = SerialState {
        x,
        h,
        normed,
        q_normed,
        k_normed,
        cache: s.cache.layers_mut().iter_mut().enumerate(),
        layers: layers.iter_mut().enumerate(),
        weights: s.record_probs.then(|| s.probs.iter_mut()),
        error: None,
    };
    // At most: a product's parts (4 per member), a split attention's scoring units (about
    // 4 per member, plus one per KV head for rounding), or its query-head units.
    let items = 4 * n + c.n_kv_heads + c.n_heads;
    let width = c.hidden_size.max(c.q_dim()).max(c.intermediate_size);
    let relay = Relay::new(items, width, serial);
    let [qkv_cuts, q_cuts, proj_cuts, logits_cuts] = &*cuts;
    let boards = match (
        relay.board(qkv, qkv_cuts),
        relay.board(q, q_cuts),
        relay.board(proj, proj_cuts),
        relay.board(&mut s.logits, logits_cuts),
    ) {
        (Some(qkv), Some(q), Some(proj), Some(logits)) => Boards {
            qkv,
            q,
            proj,
            logits,
        },
        _ => return Some(Err(cut_error())),
    };
    let step = Step {
        model,
        boards,
        views: (0..c.n_layers).map(|_| OnceLock::new()).collect(),
        pos,
        split: s.attn_split,
        members: n,
    };
    let ran = relay::run(n, &relay, &|id| {
        let mut member = Member {
            seat: Seat::new(&relay, id, n),
            st: &step,
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
        // A member's errors are the serial state's (the phase that found one failed the
        // step).
        let _ = model.step(&mut member);
    });
    ran?;
    drop(step);
    let failed = relay.failed();
    Some(match relay.into_serial().error {
        Some(e) => Err(e),
        None if failed => Err(Error::Generate("a team step failed".into())),
        None => Ok(()),
    })
}

fn cut_error() -> Error {
    Error::Generate("a team step's board is cut past its buffer".into())
}

fn order_error() -> Error {
    Error::Generate("a team step's layers ran out of order".into())
}

/// What the serial phases of a step share (one of them at a time, [`Seat::solo`]).
struct SerialState<'a> {
    /// the residual stream
    x: &'a mut [f32],
    /// its normed copy, sent to the next product
    h: &'a mut [f32],
    /// a block's post-normed output (Gemma)
    normed: &'a mut Vec<f32>,
    /// the per-head-normed `q` and `k` (Qwen3, Gemma 3)
    q_normed: &'a mut Vec<f32>,
    k_normed: &'a mut Vec<f32>,
    /// the cache's layers, each taken at its append
    cache: Enumerate<IterMut<'a, LayerKv>>,
    /// each model layer's attention state, taken when it prepares
    layers: Enumerate<IterMut<'a, LayerScratch>>,
    /// each model layer's recorded weights, when the session records them
    weights: Option<IterMut<'a, Vec<f32>>>,
    /// the error that failed the step
    error: Option<Error>,
}

/// The shared part of a step, read by every member.
struct Step<'m, 'a> {
    model: &'m Model,
    boards: Boards<'a>,
    /// each model layer's attention, as its serial phase prepared it
    views: Vec<OnceLock<View<'a>>>,
    pos: usize,
    split: AttnSplit,
    members: usize,
}

/// The boards products publish into (cut by [`RelayScratch::cuts`]).
struct Boards<'a> {
    qkv: Board<'a>,
    q: Board<'a>,
    proj: Board<'a>,
    logits: Board<'a>,
}

/// One layer's prepared attention, the same for the rest of the step.
struct View<'a> {
    /// the cache layer it reads (its own after the append, or its source's)
    layer: &'a LayerKv,
    tables: &'a StepTables,
    /// how it is split within KV heads, if it is
    plan: Option<SplitPlan>,
    /// the split's scores
    scores: Option<Board<'a>>,
    /// the recorded weights (`(n_heads, stored)`, the session's `probs` of this layer)
    weights: Option<Board<'a>>,
}

/// A layer's per-head q and k norm weights, and their epsilon.
type Norms<'m> = (&'m Option<Vec<f32>>, &'m Option<Vec<f32>>, f32);

/// `x`, per-head normed by `w` when the layer has such a norm (into `copy`).
fn head_normed<'x>(
    x: &'x [f32],
    w: &Option<Vec<f32>>,
    eps: f32,
    copy: &'x mut Vec<f32>,
) -> &'x [f32] {
    if w.is_none() {
        return x;
    }
    copy.clear();
    copy.extend_from_slice(x);
    head_norm(copy, w, eps);
    copy
}

impl<'a> SerialState<'a> {
    /// Layer `l`'s serial phase before its attention: checks this step's K/V (`check`),
    /// applies the per-head norms, appends (`Kv::Own`), prepares the layer's tables, and
    /// hands the layer's [`View`] to its items.
    fn prepare_layer(
        &mut self,
        st: &Step<'_, 'a>,
        ser: &Serial<'_>,
        (l, kv): (usize, Kv),
        check: Option<usize>,
        norms: Option<Norms<'_>>,
    ) -> Result<()> {
        let (c, rope, pos) = (&st.model.cfg, &st.model.ropes[l], st.pos);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let (q, k, v) = match kv {
            Kv::Own => {
                let qkv = st.boards.qkv.read(ser);
                (&qkv[..qd], &qkv[qd..qd + kvd], &qkv[qd + kvd..qd + 2 * kvd])
            }
            Kv::Shared(_) => (st.boards.q.read(ser), &[][..], &[][..]),
        };
        if let Some(l) = check {
            check_finite_kv(k, v, l, pos)?;
        }
        let (q, k) = match norms {
            Some((q_norm, k_norm, eps)) => (
                head_normed(q, q_norm, eps, self.q_normed),
                head_normed(k, k_norm, eps, self.k_normed),
            ),
            None => (q, k),
        };
        let (at, scratch) = self.layers.next().ok_or_else(order_error)?;
        if at != l {
            return Err(order_error());
        }
        let LayerScratch {
            tables,
            scores,
            score_cuts,
            weight_cuts,
        } = scratch;
        let layer: &'a LayerKv = match kv {
            Kv::Own => {
                let (i, layer) = self.cache.next().ok_or_else(order_error)?;
                if i != l {
                    return Err(order_error());
                }
                append_kv(c, rope, layer, k, v, pos, tables);
                layer
            }
            Kv::Shared(src) => {
                let view = st.views.get(src).and_then(OnceLock::get);
                view.ok_or_else(order_error)?.layer
            }
        };
        prepare_step(c, rope, layer, q, pos, tables);
        let (n, nkv, group) = (layer.len(), c.n_kv_heads, c.group());
        let plan = (st.split.splits(nkv, st.members, n))
            .then(|| SplitPlan::new(n, st.members, nkv, group));
        let scores = match plan {
            Some(plan) => {
                scores.resize(c.n_heads * n, 0.0);
                score_cuts.clear();
                score_cuts.extend((0..=plan.score_units()).map(|u| plan.score_at(u)));
                Some(ser.board_once(scores, score_cuts).ok_or_else(cut_error)?)
            }
            None => None,
        };
        let weights = match self.weights.as_mut().map(Iterator::next) {
            None => None,
            Some(None) => return Err(order_error()),
            Some(Some(w)) => {
                // Every value is published: each attention item writes its heads' weights.
                w.resize(c.n_heads * n, 0.0);
                weight_cuts.clear();
                match plan {
                    Some(plan) => {
                        weight_cuts.extend((0..=plan.mix_units()).map(|u| plan.mix_head(u) * n))
                    }
                    None => weight_cuts.extend((0..=nkv).map(|h| h * group * n)),
                }
                Some(ser.board_once(w, weight_cuts).ok_or_else(cut_error)?)
            }
        };
        let view = View {
            layer,
            tables,
            plan,
            scores,
            weights,
        };
        st.views[l].set(view).map_err(|_| order_error())
    }
}

struct Member<'r, 's, 'm, 'a> {
    seat: Seat<'r, SerialState<'a>>,
    st: &'s Step<'m, 'a>,
    acts: QuantizedActs,
    /// the claimed item's result
    out: Vec<f32>,
    /// the claimed item's `up` rows (the GLU)
    up: Vec<f32>,
    /// `(matrix, rows)` of the claimed item's pieces in `out`
    pieces: Vec<(usize, Range<usize>)>,
    attn: HeadScratch,
    /// a query-head unit's scores (the softmax runs on them in place)
    probs: Vec<f32>,
    /// `x += post_norm(proj)` of the last residual, run by the next serial phase (a norm):
    /// the post norm and its epsilon
    pending_add: Option<(&'m Option<Vec<f32>>, f32)>,
    /// the layer whose K/V the next serial phase (the append) checks first
    pending_check: Option<usize>,
    /// the per-head q and k norms it applies next
    pending_norms: Option<Norms<'m>>,
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

impl<'m> Member<'_, '_, 'm, '_> {
    /// `board = mats · input` (plus `biases`, soft-capped when `cap` is given), the input
    /// being what was sent to input buffer `buf`; the matrices' rows one after the other.
    fn product(
        &mut self,
        mats: &[&Matrix],
        buf: usize,
        board: &Board,
        biases: &[&Option<Vec<f32>>],
        cap: Option<f32>,
    ) {
        let parts = row_parts(mats, self.seat.n);
        let forms = quantized_forms(mats);
        let (acts, out, pieces) = (&mut self.acts, &mut self.out, &mut self.pieces);
        let mut quantized = false;
        let phase = Phase {
            items: parts,
            input: Some((buf, mats[0].cols)),
            writes: Some(board),
            ..Phase::default()
        };
        self.seat.chunks(phase, |k, part| match part {
            Part::Compute { input: x, .. } => {
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
            Part::Publish(dst) => {
                dst.copy_from_slice(out);
                let mut at = 0;
                for (i, r) in pieces.iter() {
                    let o = &mut dst[at..at + r.len()];
                    if let Some(bias) = biases[*i] {
                        ops::add_assign(o, &bias[r.clone()]);
                    }
                    soft_cap(o, cap);
                    at += r.len();
                }
            }
        });
    }

    /// A serial phase: the last residual's add, then `h = rmsnorm(x) · w`, checked by
    /// `check` (a failure fails the step), sent to the next product (input buffer 0).
    fn norm_and_send(&mut self, w: &[f32], eps: f32, check: impl FnOnce(&[f32]) -> Result<()>) {
        let (st, add) = (self.st, self.pending_add.take());
        self.seat.solo(|state, ser| {
            let SerialState {
                x,
                h,
                normed,
                error,
                ..
            } = state;
            if let Some((post_norm, add_eps)) = add {
                add_output(x, st.boards.proj.read(ser), post_norm, add_eps, normed);
            }
            ops::rmsnorm(x, w, eps, h);
            match check(h) {
                Ok(()) => ser.send(0, 0, h),
                Err(e) => {
                    error.get_or_insert(e);
                    ser.fail();
                }
            }
        });
    }

    /// Whole KV heads, one per item, then an empty phase (the split's second).
    fn attend_whole(&mut self, c: &Config, l: usize, view: &View) {
        let (rope, width) = (&self.st.model.ropes[l], c.group() * c.head_dim);
        let (hs, out, tx) = (&mut self.attn, &mut self.out, self.seat.sender());
        let phase = Phase {
            items: c.n_kv_heads,
            writes: view.weights.as_ref(),
            ..Phase::default()
        };
        self.seat.chunks(phase, |h, part| match part {
            Part::Compute { .. } => {
                out.resize(width, 0.0);
                let hs = std::slice::from_mut(hs);
                attend_heads(c, rope, view.layer, view.tables, h, hs, out);
            }
            Part::Publish(weights) => {
                tx.send(1, h * width, &out[..width]);
                weights.copy_from_slice(&hs.weights()[..weights.len()]);
            }
        });
        // Every member counts the same phases.
        self.seat.chunks(Phase::default(), |_, _| {});
    }

    /// Split ([`SplitPlan`]): the scores of row ranges into the layer's score board, then
    /// the softmax and weighted sum of runs of query heads.
    fn attend_split(&mut self, c: &Config, l: usize, view: &View, plan: SplitPlan) {
        let (rope, hd, group) = (&self.st.model.ropes[l], c.head_dim, c.group());
        let (hs, out, probs) = (&mut self.attn, &mut self.out, &mut self.probs);
        let tx = self.seat.sender();
        let score = Phase {
            items: plan.score_units(),
            writes: view.scores.as_ref(),
            ..Phase::default()
        };
        self.seat.chunks(score, |u, part| match part {
            Part::Compute { .. } => {
                let (h, rows) = plan.score_unit(u);
                let len = rows.len();
                out.resize(group * len, 0.0);
                score_rows(c, rope, view.layer, view.tables, h, rows, hs, out, len);
            }
            Part::Publish(scores) => scores.copy_from_slice(&out[..scores.len()]),
        });
        let mix = Phase {
            items: plan.mix_units(),
            reads: view.scores.as_ref(),
            writes: view.weights.as_ref(),
            ..Phase::default()
        };
        self.seat.chunks(mix, |u, part| {
            let (h, js) = plan.mix_unit(u);
            let width = js.len() * hd;
            match part {
                Part::Compute { read, .. } => {
                    plan.gather(read, h, js, probs);
                    out.resize(width, 0.0);
                    mix_query_heads(c, rope, view.layer, view.tables, h, probs, out);
                }
                Part::Publish(weights) => {
                    tx.send(1, plan.mix_head(u) * hd, &out[..width]);
                    weights.copy_from_slice(&probs[..weights.len()]);
                }
            }
        });
    }
}

impl<'m> Exec<'m> for Member<'_, '_, 'm, '_> {
    fn norm(&mut self, w: &'m [f32], eps: f32) {
        self.norm_and_send(w, eps, |_| Ok(()));
    }

    fn project(&mut self, mats: &[&'m Matrix], biases: [&'m Option<Vec<f32>>; 3]) {
        let boards = &self.st.boards;
        let board = match mats.len() {
            1 => &boards.q,
            _ => &boards.qkv,
        };
        self.product(mats, 0, board, &biases[..mats.len()], None);
    }

    /// Deferred to the append's serial phase ([`Exec::attend`]), which checks first.
    fn check_kv(&mut self, l: usize) -> Result<()> {
        self.pending_check = Some(l);
        Ok(())
    }

    /// Deferred to the append's serial phase ([`Exec::attend`]), after the check.
    fn head_norms(&mut self, q_norm: &'m Option<Vec<f32>>, k_norm: &'m Option<Vec<f32>>, eps: f32) {
        self.pending_norms = Some((q_norm, k_norm, eps));
    }

    /// A serial phase appends the K/V (`Kv::Own`) and prepares layer `l`'s attention (its
    /// own tables: a late member may still read an earlier layer's); then two chunked
    /// phases: whole KV heads (and an empty one), or, split ([`AttnSplit`]), the scores of
    /// row ranges, then the softmax and weighted sum per run of query heads.
    fn attend(&mut self, model: &'m Model, l: usize, kv: Kv) -> Result<()> {
        let st = self.st;
        let (check, norms) = (self.pending_check.take(), self.pending_norms.take());
        self.seat.solo(|state, ser| {
            if let Err(e) = state.prepare_layer(st, ser, (l, kv), check, norms) {
                state.error.get_or_insert(e);
                ser.fail();
            }
        });
        // Set before the serial phase ended, unless it failed the step.
        let Some(view) = st.views[l].get() else {
            // Skipped, and counted all the same.
            self.seat.chunks(Phase::default(), |_, _| {});
            self.seat.chunks(Phase::default(), |_, _| {});
            return Ok(());
        };
        match view.plan {
            None => self.attend_whole(&model.cfg, l, view),
            Some(plan) => self.attend_split(&model.cfg, l, view, plan),
        }
        Ok(())
    }

    /// The product of what attention or the GLU published (input buffer 1) into `proj`;
    /// the next serial phase (a norm) adds it to `x`.
    fn residual(
        &mut self,
        w: &'m Matrix,
        _input: Input,
        post_norm: &'m Option<Vec<f32>>,
        eps: f32,
    ) {
        let board = &self.st.boards.proj;
        self.product(&[w], 1, board, &[&None], None);
        self.pending_add = Some((post_norm, eps));
    }

    /// Gate and up on the same rows, the GLU on the item's rows.
    fn gated(&mut self, c: &'m Config, w_gate: &'m Matrix, w_up: &'m Matrix) {
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
        let phase = Phase {
            items: parts,
            input: Some((0, w_gate.cols)),
            ..Phase::default()
        };
        self.seat.chunks(phase, |k, part| match part {
            Part::Compute { input: x, .. } => {
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
            Part::Publish(_) => {
                for (_, r) in pieces.iter() {
                    // `down_proj`'s input.
                    tx.send(1, r.start, &out[..r.len()]);
                }
            }
        });
    }

    fn logits(
        &mut self,
        norm: &'m [f32],
        eps: f32,
        lm_head: &'m Matrix,
        cap: Option<f32>,
    ) -> Result<()> {
        let pos = self.st.pos;
        self.norm_and_send(norm, eps, |h| check_finite_hidden(h, pos));
        let board = &self.st.boards.logits;
        self.product(&[lm_head], 0, board, &[&None], cap);
        Ok(())
    }
}
