//! The [`Exec`] that holds every token of a set of sequences as rows: a decode step (one
//! sequence, one token), a prefill chunk (one sequence, many tokens) and a serve step
//! (many sequences) are the same code with different row counts. Products run over all
//! rows at once ([`matmul`] and [`matmul_many`], which are [`matvec`]'s values bit for bit
//! and are `matvec` for one row), each a rayon fork/join; attention runs per sequence,
//! token by token in order, sequences in parallel.

use super::{
    add_bias, check_finite_hidden, check_finite_kv, glu, head_norm, norm_rows, post_norm_rows,
    soft_cap, Exec, Input, Kv, Model, Replay, SeqStep, StepBufs,
};
use crate::attention::{append_kv, attend, attend_stored};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::ops::{self, matmul, matmul_many, matmul_rows, Matrix};
use rayon::prelude::*;

/// Runs [`Model::step`] over the tokens of `steps`; a step whose
/// [`SeqStep::all_logits`] is set receives every one of its tokens' logits there.
pub(super) fn run(model: &Model, steps: &mut [SeqStep<'_>]) -> Result<()> {
    run_with(model, steps, |model, rows| model.step(rows))
}

/// [`run`], with `step` running the forward pass over the prepared rows (the profiler
/// wraps them: [`super::profile`]).
pub(super) fn run_with<'m>(
    model: &'m Model,
    steps: &mut [SeqStep<'_>],
    step: impl FnOnce(&'m Model, &mut Rows<'_, '_>) -> Result<()>,
) -> Result<()> {
    let c = &model.cfg;
    if steps.iter().any(|st| st.tokens.is_empty()) {
        return Err(Error::Generate(
            "a sequence in a batched step has no token to run".into(),
        ));
    }
    // Row offset of each sequence's first token in the stacked activations.
    let mut offsets = Vec::with_capacity(steps.len());
    let mut n = 0usize;
    for st in steps.iter() {
        offsets.push(n);
        n += st.tokens.len();
    }
    if n == 0 {
        return Ok(());
    }
    // A decode step runs in its session's own buffers (no allocation per token).
    let old = match steps.len() {
        1 => std::mem::take(&mut steps[0].session.bufs),
        _ => StepBufs::default(),
    };
    let mut b = StepBufs::reuse(old, c, n);
    let hd = c.hidden_size;
    for (st, &o) in steps.iter().zip(&offsets) {
        for (i, &t) in st.tokens.iter().enumerate() {
            model.check_token(t)?;
            model.embed_row(t, &mut b.x[(o + i) * hd..(o + i + 1) * hd]);
        }
    }
    // A YOCO source layer's cache before the step and the step's K/V rows, per sequence
    // of more than one token (see `Rows::attend`).
    let replay = steps
        .iter()
        .map(
            |st| match c.num_kv_shared_layers > 0 && st.tokens.len() > 1 {
                true => vec![None; c.n_layers],
                false => Vec::new(),
            },
        )
        .collect();
    let mut rows = Rows {
        c,
        steps,
        offsets,
        b,
        replay,
    };
    let result = step(model, &mut rows);
    if rows.b.n == 1 {
        rows.steps[0].session.bufs = rows.b;
    }
    result
}

/// One sequence's share of [`Rows::attend`]: its step, its replay slots, its first row
/// and its rows of `att`.
type SeqAttend<'a, 's, 'b> = (
    (&'a mut SeqStep<'s>, &'a mut Vec<Option<Replay>>),
    (&'a usize, &'a mut &'b mut [f32]),
);

pub(super) struct Rows<'r, 's> {
    c: &'r Config,
    steps: &'r mut [SeqStep<'s>],
    /// row of each sequence's first token
    offsets: Vec<usize>,
    b: StepBufs,
    /// `replay[seq][l]`: what a shared layer needs to replay layer `l`'s appends.
    replay: Vec<Vec<Option<Replay>>>,
}

impl Exec<'_> for Rows<'_, '_> {
    fn norm(&mut self, w: &[f32], eps: f32) {
        norm_rows(&self.b.x, w, eps, &mut self.b.h);
    }

    fn project(&mut self, mats: &[&Matrix], biases: [&Option<Vec<f32>>; 3]) {
        let b = &mut self.b;
        let mut outs: Vec<&mut [f32]> = vec![&mut b.q, &mut b.k, &mut b.v];
        outs.truncate(mats.len());
        matmul_many(mats, &b.h, b.n, &mut outs);
        for ((out, bias), m) in outs.iter_mut().zip(biases).zip(mats) {
            out.chunks_exact_mut(m.rows).for_each(|r| add_bias(r, bias));
        }
    }

    fn check_kv(&mut self, l: usize) -> Result<()> {
        check_finite_kv(&self.b.k, &self.b.v, l, self.steps[0].start)
    }

    fn head_norms(&mut self, q_norm: &Option<Vec<f32>>, k_norm: &Option<Vec<f32>>, eps: f32) {
        head_norm(&mut self.b.q, q_norm, eps);
        head_norm(&mut self.b.k, k_norm, eps);
    }

    /// A sequence of several tokens in a layer that shared layers read saves that layer's
    /// cache before the step and the step's K/V rows; a shared layer replays the appends on
    /// a copy, so its query `i` sees exactly the rows stored after token `i` (eviction and
    /// KIVI grouping included), as in token-by-token decoding.
    fn attend(&mut self, model: &Model, l: usize, kv: Kv) -> Result<()> {
        let (c, rope) = (self.c, &model.ropes[l]);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let keep = matches!(kv, Kv::Own) && model.kv_source.iter().skip(l + 1).any(|&s| s == l);
        let b = &mut self.b;
        let (q, k, v) = (&b.q, &b.k, &b.v);
        // Each sequence's rows of `att`.
        let mut att: Vec<&mut [f32]> = Vec::with_capacity(self.steps.len());
        let mut rest: &mut [f32] = &mut b.att;
        for st in self.steps.iter() {
            let (a, r) = rest.split_at_mut(st.tokens.len() * qd);
            att.push(a);
            rest = r;
        }
        let one = |((st, replay), (&o, att)): SeqAttend<'_, '_, '_>| -> Result<()> {
            let s = &mut *st.session;
            let (cache, scratch) = (&mut s.cache, &mut s.scratch);
            let len = st.tokens.len();
            let row = |i: usize, d: usize| (o + i) * d..(o + i + 1) * d;
            let mut probs = s.record_probs.then_some(&mut s.probs[l]);
            match kv {
                Kv::Own => {
                    if keep && len > 1 {
                        let rows = o * kvd..(o + len) * kvd;
                        let before = cache.layer(l).clone();
                        replay[l] = Some((before, k[rows.clone()].to_vec(), v[rows].to_vec()));
                    }
                    for i in 0..len {
                        attend(
                            c,
                            rope,
                            cache.layer_mut(l),
                            &q[row(i, qd)],
                            &k[row(i, kvd)],
                            &v[row(i, kvd)],
                            st.start + i,
                            &mut att[i * qd..(i + 1) * qd],
                            scratch,
                            probs.as_deref_mut(),
                        );
                    }
                }
                Kv::Shared(src) if len == 1 => attend_stored(
                    c,
                    rope,
                    cache.layer(src),
                    &q[row(0, qd)],
                    st.start,
                    att,
                    scratch,
                    probs,
                ),
                Kv::Shared(src) => {
                    let Some((before, ks, vs)) = replay.get(src).and_then(Option::as_ref) else {
                        return Err(Error::Generate(format!(
                            "layer {l} shares the cache of layer {src}, which did not keep \
                             this step's rows"
                        )));
                    };
                    let mut layer = before.clone();
                    for i in 0..len {
                        // The source layer's own RoPE table: the rows it would have stored.
                        let r = i * kvd..(i + 1) * kvd;
                        let tables = scratch.split_mut().0;
                        let src_rope = &model.ropes[src];
                        append_kv(
                            c,
                            src_rope,
                            &mut layer,
                            &ks[r.clone()],
                            &vs[r],
                            st.start + i,
                            tables,
                        );
                        attend_stored(
                            c,
                            rope,
                            &layer,
                            &q[row(i, qd)],
                            st.start + i,
                            &mut att[i * qd..(i + 1) * qd],
                            scratch,
                            probs.as_deref_mut(),
                        );
                    }
                }
            }
            Ok(())
        };
        let (steps, replay) = (&mut *self.steps, &mut self.replay);
        if steps.len() > 1 && crate::threads::current() > 1 {
            steps
                .par_iter_mut()
                .zip(replay.par_iter_mut())
                .zip(self.offsets.par_iter().zip(att.par_iter_mut()))
                .try_for_each(one)
        } else {
            steps
                .iter_mut()
                .zip(replay.iter_mut())
                .zip(self.offsets.iter().zip(att.iter_mut()))
                .try_for_each(one)
        }
    }

    fn residual(&mut self, w: &Matrix, input: Input, post_norm: &Option<Vec<f32>>, eps: f32) {
        let b = &mut self.b;
        let input = match input {
            Input::Att => &b.att,
            Input::Gate => &b.gate,
        };
        matmul(w, input, b.n, &mut b.proj);
        post_norm_rows(&mut b.proj, post_norm, eps);
        ops::add_assign(&mut b.x, &b.proj);
    }

    fn gated(&mut self, c: &Config, w_gate: &Matrix, w_up: &Matrix) {
        let b = &mut self.b;
        matmul_many(&[w_gate, w_up], &b.h, b.n, &mut [&mut b.gate, &mut b.up]);
        // Row by row, so the SIMD/tail split of each row is the one a single token sees.
        let ff = c.intermediate_size;
        b.gate
            .chunks_exact_mut(ff)
            .zip(b.up.chunks_exact(ff))
            .for_each(|(g, u)| glu(c, g, u));
    }

    fn logits(&mut self, norm: &[f32], eps: f32, lm_head: &Matrix, cap: Option<f32>) -> Result<()> {
        let (c, b) = (self.c, &mut self.b);
        let (hd, vocab) = (c.hidden_size, c.vocab_size);
        if self.steps.iter().any(|st| st.all_logits.is_some()) {
            let steps = &mut *self.steps;
            return every_logits(steps, &self.offsets, b, vocab, norm, eps, lm_head, cap);
        }
        // Each sequence's last token only: (sequences, hidden) → (sequences, vocab), into
        // the sessions' own logits. `h` has a row per token, so at least one per sequence.
        let last = &mut b.h[..self.steps.len() * hd];
        for ((st, &o), hr) in self
            .steps
            .iter()
            .zip(&self.offsets)
            .zip(last.chunks_exact_mut(hd))
        {
            let r = o + st.tokens.len() - 1;
            ops::rmsnorm(&b.x[r * hd..(r + 1) * hd], norm, eps, hr);
            check_finite_hidden(hr, st.start + st.tokens.len() - 1)?;
        }
        let mut logits: Vec<&mut [f32]> = self
            .steps
            .iter_mut()
            .map(|st| &mut st.session.logits[..])
            .collect();
        matmul_rows(lm_head, last, &mut logits);
        if cap.is_some() {
            logits.par_iter_mut().for_each(|r| soft_cap(r, cap));
        }
        Ok(())
    }
}

/// The LM head when some sequences ask for every token's logits ([`SeqStep::all_logits`],
/// a speculative verification pass): their every row, and the other sequences' last row,
/// in one product (each row's values are [`matvec`](crate::ops::matvec)'s, whatever the
/// batch); a sequence's own `logits` get its last row's, as without.
#[allow(clippy::too_many_arguments)]
fn every_logits(
    steps: &mut [SeqStep<'_>],
    offsets: &[usize],
    b: &mut StepBufs,
    vocab: usize,
    norm: &[f32],
    eps: f32,
    lm_head: &Matrix,
    cap: Option<f32>,
) -> Result<()> {
    let (n, hd) = (b.n, norm.len());
    if let [st] = &mut *steps {
        if let Some(all) = st.all_logits.as_deref_mut() {
            // One sequence: one product over every row.
            norm_rows(&b.x, norm, eps, &mut b.h);
            check_finite_hidden(&b.h, st.start)?;
            all.resize(n * vocab, 0.0);
            matmul(lm_head, &b.h, n, all);
            if cap.is_some() {
                all.par_chunks_mut(vocab).for_each(|r| soft_cap(r, cap));
            }
            st.session
                .logits
                .copy_from_slice(&all[(n - 1) * vocab..n * vocab]);
            return Ok(());
        }
    }
    // (row in the step, position) of every row the head runs on, in sequence order.
    let mut picked = Vec::with_capacity(steps.len());
    for (st, &o) in steps.iter().zip(offsets) {
        let len = st.tokens.len();
        let from = if st.all_logits.is_some() { 0 } else { len - 1 };
        picked.extend((from..len).map(|i| (o + i, st.start + i)));
    }
    let rows = &mut b.h[..picked.len() * hd];
    for (&(r, pos), hr) in picked.iter().zip(rows.chunks_exact_mut(hd)) {
        ops::rmsnorm(&b.x[r * hd..(r + 1) * hd], norm, eps, hr);
        check_finite_hidden(hr, pos)?;
    }
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(picked.len());
    for st in steps.iter_mut() {
        match st.all_logits.as_deref_mut() {
            Some(all) => {
                all.resize(st.tokens.len() * vocab, 0.0);
                outs.extend(all.chunks_exact_mut(vocab));
            }
            None => outs.push(&mut st.session.logits[..]),
        }
    }
    matmul_rows(lm_head, rows, &mut outs);
    if cap.is_some() {
        outs.par_iter_mut().for_each(|r| soft_cap(r, cap));
    }
    drop(outs);
    for st in steps.iter_mut() {
        let len = st.tokens.len();
        if let Some(all) = st.all_logits.as_deref() {
            st.session
                .logits
                .copy_from_slice(&all[(len - 1) * vocab..len * vocab]);
        }
    }
    Ok(())
}
