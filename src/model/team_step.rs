//! The [`Exec`] of a decode team member ([`crate::team`]): one sequence, one token, every
//! thread of the pool running the whole step on its share of each product (and of the KV
//! heads), meeting at a barrier six times per layer instead of a rayon fork/join per
//! product. The residual stream is private: every member adds each complete block output
//! to its own copy and norms it itself, which saves a sync.

use super::{
    add_output, check_finite_hidden, check_finite_kv, glu, Exec, Input, Kv, Model, Session,
    StepBufs,
};
use crate::attention::{
    append_kv, attend_heads, copy_probs, observe_step, prepare_step, HeadScratch, StepTables,
};
use crate::config::Config;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::ops::matvec::{quantized_forms, row_part, row_parts, rows_into};
use crate::ops::qdot::QuantizedActs;
use crate::ops::{self, Matrix};
use crate::team::{self, Member, SharedCell, SharedSlice};

/// [`Model::forward`] as a decode team. The caller has checked `token`.
pub(super) fn run_step(model: &Model, s: &mut Session, token: u32, pos: usize) -> Result<()> {
    let c = &model.cfg;
    let mut bufs = StepBufs::reuse(std::mem::take(&mut s.bufs), c, 1);
    model.embed_row(token, &mut bufs.x);
    let (tables, heads) = s.scratch.split_mut();
    let shared = TeamBufs {
        x0: &bufs.x,
        q: SharedSlice::new(&mut bufs.q),
        k: SharedSlice::new(&mut bufs.k),
        v: SharedSlice::new(&mut bufs.v),
        att: SharedSlice::new(&mut bufs.att),
        proj: SharedSlice::new(&mut bufs.proj),
        gate: SharedSlice::new(&mut bufs.gate),
        up: SharedSlice::new(&mut bufs.up),
        logits: SharedSlice::new(&mut s.logits),
        cache: SharedCell::new(&mut s.cache),
        tables: SharedCell::new(tables),
        heads: SharedSlice::new(heads),
        probs: s.record_probs.then(|| SharedCell::new(&mut s.probs)),
    };
    // Every member takes the same branches, so all return the same error (or none).
    let results = team::run(|m| {
        model.step(&mut TeamMember {
            m,
            b: &shared,
            x: shared.x0.to_vec(),
            h: vec![0.0; c.hidden_size],
            acts: QuantizedActs::default(),
            pos,
            q_normed: None,
            k_normed: None,
        })
    });
    s.bufs = bufs;
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(())
}

/// One member's state: its private residual stream `x` and normed copy `h`, its
/// quantised activations, and (member 0) the step's per-head-normed q and k.
struct TeamMember<'m, 'b, 'a> {
    m: &'m Member<'m>,
    b: &'b TeamBufs<'a>,
    x: Vec<f32>,
    h: Vec<f32>,
    acts: QuantizedActs,
    pos: usize,
    q_normed: Option<Vec<f32>>,
    k_normed: Option<Vec<f32>>,
}

impl Exec for TeamMember<'_, '_, '_> {
    fn norm(&mut self, w: &[f32], eps: f32) {
        ops::rmsnorm(&self.x, w, eps, &mut self.h);
    }

    /// Each member its claimed rows of `q`, `k`, `v` — sync.
    fn project(&mut self, mats: &[&Matrix], biases: [&Option<Vec<f32>>; 3]) {
        let b = self.b;
        let outs = [(&b.q, biases[0]), (&b.k, biases[1]), (&b.v, biases[2])];
        team_product(self.m, mats, &self.h, &mut self.acts, &outs[..mats.len()]);
        self.m.sync();
    }

    fn check_kv(&mut self, l: usize) -> Result<()> {
        // SAFETY: `k`/`v` are complete (the projection ended with a sync) and nobody
        // writes them until the next layer's projection, several syncs later.
        let (k, v) = unsafe { (self.b.k.all(), self.b.v.all()) };
        check_finite_kv(k, v, l, self.pos)
    }

    /// Member 0 only (it alone appends and prepares the step), on its own copies: the
    /// others may still be reading `q`/`k` for the finiteness check.
    fn head_norms(&mut self, q_norm: &Option<Vec<f32>>, k_norm: &Option<Vec<f32>>, eps: f32) {
        if self.m.id != 0 {
            return;
        }
        // SAFETY: as in `check_kv`; these are reads.
        let (q, k) = unsafe { (self.b.q.all(), self.b.k.all()) };
        let normed = |x: &[f32], w: &Option<Vec<f32>>| -> Option<Vec<f32>> {
            w.as_ref().map(|w| {
                let mut x = x.to_vec();
                ops::head_rmsnorm(&mut x, w, eps);
                x
            })
        };
        self.q_normed = normed(q, q_norm);
        self.k_normed = normed(k, k_norm);
    }

    /// Member 0 appends the K/V and prepares the step while the others wait — sync; each
    /// member attends over the KV heads it claims — sync; member 0 lets an observing
    /// policy see the weights. Ends with `att` complete.
    fn attend(&mut self, model: &Model, l: usize, kv: Kv) -> Result<()> {
        let (c, rope, m, b) = (&model.cfg, &model.ropes[l], self.m, self.b);
        let src = match kv {
            Kv::Own => l,
            Kv::Shared(src) => src,
        };
        if m.id == 0 {
            // SAFETY: the other members wait at the sync below and hold no reference to
            // the cache or the tables (their last ones ended before the previous sync);
            // q/k/v are only read.
            let (cache, tables) = unsafe { (b.cache.get_mut(), b.tables.get_mut()) };
            let (q, k, v) = unsafe { (b.q.all(), b.k.all(), b.v.all()) };
            let q = self.q_normed.as_deref().unwrap_or(q);
            if let Kv::Own = kv {
                let k = self.k_normed.as_deref().unwrap_or(k);
                append_kv(c, rope, cache.layer_mut(l), k, v, self.pos, tables);
            }
            prepare_step(c, rope, cache.layer(src), q, self.pos, tables);
        }
        m.sync();
        let width = c.group() * c.head_dim;
        m.claim_each(c.n_kv_heads, |h| {
            // SAFETY: nobody changes the cache or the tables until the sync below; each
            // KV head is claimed once, with its scratch and its rows of `att`.
            let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
            let hs: &mut [HeadScratch] = unsafe { b.heads.range_mut(h..h + 1) };
            let out = unsafe { b.att.range_mut(h * width..(h + 1) * width) };
            attend_heads(c, rope, cache.layer(src), tables, h, hs, out);
        });
        m.sync();
        if m.id == 0 {
            // SAFETY: the heads' scratch is complete; the others now only run `o_proj`,
            // which touches neither the cache nor the scratch, until later syncs.
            let (cache, heads) = unsafe { (b.cache.get_mut(), b.heads.all()) };
            if let Kv::Own = kv {
                observe_step(cache.layer_mut(l), heads);
            }
            if let Some(p) = &b.probs {
                // SAFETY: only member 0 ever touches the recorded weights.
                let probs = unsafe { p.get_mut() };
                let n = cache.layer(src).len();
                copy_probs(heads, c.group() * n, &mut probs[l]);
            }
        }
        Ok(())
    }

    /// Each member its rows of `proj` — sync; then every member adds all of it.
    fn residual(&mut self, w: &Matrix, input: Input, post_norm: &Option<Vec<f32>>, eps: f32) {
        let b = self.b;
        // SAFETY: `att` is complete after the attention's last sync and next written in
        // the next layer's attention; `gate` after the MLP's sync, next written in the
        // next layer's MLP.
        let input = unsafe {
            match input {
                Input::Att => b.att.all(),
                Input::Gate => b.gate.all(),
            }
        };
        team_product(self.m, &[w], input, &mut self.acts, &[(&b.proj, &None)]);
        self.m.sync();
        // SAFETY: `proj` is complete; it is next written after at least one more sync
        // (the MLP's, or the next layer's projection's).
        add_output(&mut self.x, unsafe { b.proj.all() }, post_norm, eps);
    }

    /// Gate and up on the same rows, so the GLU needs no sync of its own — sync.
    fn gated(&mut self, c: &Config, w_gate: &Matrix, w_up: &Matrix) {
        let (m, b, h) = (self.m, self.b, &self.h);
        let pair = [w_gate, w_up];
        let q = quantize_for(&pair, h, &mut self.acts);
        let parts = row_parts(&pair[..1], m.n);
        m.claim_each(parts, |k| {
            row_part(&pair[..1], k, parts, |_, r| {
                // SAFETY: each part is claimed once; `gate`/`up` are read only after the
                // next sync.
                let (g, u) = unsafe { (b.gate.range_mut(r.clone()), b.up.range_mut(r.clone())) };
                rows_into(w_gate, h, q, r.start, g);
                rows_into(w_up, h, q, r.start, u);
                // Parts start on multiples of 8 rows: the same 8-lane chunks as a whole
                // vector's GLU.
                glu(c, g, u);
            })
        });
        m.sync();
    }

    /// Each member its rows of the logits.
    fn logits(&mut self, norm: &[f32], eps: f32, lm_head: &Matrix) -> Result<()> {
        ops::rmsnorm(&self.x, norm, eps, &mut self.h);
        check_finite_hidden(&self.h, self.pos)?;
        let b = self.b;
        team_product(
            self.m,
            &[lm_head],
            &self.h,
            &mut self.acts,
            &[(&b.logits, &None)],
        );
        Ok(())
    }
}

/// The buffers of one decode team step, shared by its members ([`crate::team`]). Who
/// writes what, per layer (every other access is a read of a complete buffer):
///
/// 1. each member the rows it claims of `q`, `k`, `v` — sync;
/// 2. member 0 the cache (append) and `tables` (prepare) — sync;
/// 3. each member the KV heads it claims: their `heads` and rows of `att` — sync;
/// 4. member 0 the cache again (an observing policy) and `probs`; each member its rows
///    of `proj` — sync;
/// 5. each member its rows of `gate`, `up` — sync;
/// 6. each member its rows of `proj` — sync.
///
/// After the last layer each member writes its rows of `logits`.
struct TeamBufs<'a> {
    /// the token's embedding (each member copies it into its own residual stream)
    x0: &'a [f32],
    q: SharedSlice<'a, f32>,
    k: SharedSlice<'a, f32>,
    v: SharedSlice<'a, f32>,
    att: SharedSlice<'a, f32>,
    proj: SharedSlice<'a, f32>,
    gate: SharedSlice<'a, f32>,
    up: SharedSlice<'a, f32>,
    logits: SharedSlice<'a, f32>,
    cache: SharedCell<'a, KvCache>,
    tables: SharedCell<'a, StepTables>,
    heads: SharedSlice<'a, HeadScratch>,
    probs: Option<SharedCell<'a, Vec<Vec<f32>>>>,
}

/// `x` quantised into `acts` if any of `mats` reads 8-bit activations.
fn quantize_for<'a>(
    mats: &[&Matrix],
    x: &[f32],
    acts: &'a mut QuantizedActs,
) -> Option<&'a QuantizedActs> {
    let forms = quantized_forms(mats);
    forms.any().then(|| {
        acts.quantize_forms(x, forms);
        &*acts
    })
}

/// This member's share of `outs[i] = mats[i] · x` (plus bias), on the calling thread.
fn team_product(
    m: &Member,
    mats: &[&Matrix],
    x: &[f32],
    acts: &mut QuantizedActs,
    outs: &[(&SharedSlice<f32>, &Option<Vec<f32>>)],
) {
    let q = quantize_for(mats, x, acts);
    let parts = row_parts(mats, m.n);
    m.claim_each(parts, |k| {
        row_part(mats, k, parts, |i, r| {
            // SAFETY: each part is claimed once and the outputs are read only after the
            // caller's next sync.
            let o = unsafe { outs[i].0.range_mut(r.clone()) };
            rows_into(mats[i], x, q, r.start, o);
            if let Some(bias) = outs[i].1 {
                ops::add_assign(o, &bias[r]);
            }
        })
    });
}
