//! The [`Exec`] of a decode team member ([`crate::team`]): one sequence, one token, every
//! thread of the pool running the whole step on its share of each product (and of the KV
//! heads), meeting at a barrier six times per layer instead of a rayon fork/join per
//! product. The residual stream is private: every member adds each complete block output
//! to its own copy and norms it itself, which saves a sync.

use super::{
    add_output, check_finite_hidden, check_finite_kv, glu, soft_cap, Exec, Input, Kv, Model,
    Session, StepBufs,
};
use crate::attention::{
    append_kv, attend_heads, copy_probs, mix_query_heads, observe_step, prepare_step, probs_mut,
    score_rows, size_probs, AttnSplit, HeadScratch, StepTables,
};
use crate::config::Config;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::ops::matvec::{quantized_forms, row_part, row_parts, rows_into};
use crate::ops::{self, Matrix};
use crate::team::{self, Member, SharedCell, SharedSlice};
use crate::wkernels::QuantizedActs;

/// [`Model::forward`] as a decode team. The caller has checked `token`.
pub(super) fn run_step(model: &Model, s: &mut Session, token: u32, pos: usize) -> Result<()> {
    let c = &model.cfg;
    let mut bufs = StepBufs::reuse(std::mem::take(&mut s.bufs), c, 1);
    model.embed_row(token, &mut bufs.x);
    let (tables, heads) = s.scratch.split_mut();
    let mut head_probs = vec![ProbsPtr(std::ptr::null_mut(), 0); heads.len()];
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
        head_probs: SharedSlice::new(&mut head_probs),
        split: s.attn_split,
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
            attn: HeadScratch::default(),
            scores: Vec::new(),
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
    /// scratch of this member's share of a split attention ([`score_rows`])
    attn: HeadScratch,
    /// `(group, rows)` scores of the range being scored
    scores: Vec<f32>,
}

impl Exec for TeamMember<'_, '_, '_> {
    fn norm(&mut self, w: &[f32], eps: f32) {
        ops::rmsnorm(&self.x, w, eps, &mut self.h);
    }

    /// Each member its claimed rows of `q`, `k`, `v` — sync.
    fn project(&mut self, mats: &[&Matrix], biases: [&Option<Vec<f32>>; 3]) {
        let b = self.b;
        let outs = [(&b.q, biases[0]), (&b.k, biases[1]), (&b.v, biases[2])];
        let outs = &outs[..mats.len()];
        team_product(self.m, mats, &self.h, &mut self.acts, outs, None);
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
    ///
    /// Split ([`AttnSplit`]): instead of whole KV heads, each member scores the row ranges
    /// it claims (of any KV head) — sync; then softmax and weighted sum per query head it
    /// claims. Same values bit for bit, better balanced when the KV heads are fewer than,
    /// or not a multiple of, the members.
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
            let n = cache.layer(src).len();
            if b.split.splits(c.n_kv_heads, m.n, n) {
                // SAFETY: as above; nobody else touches the heads' scratch or the
                // pointers until the sync below.
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
        }
        m.sync();
        // SAFETY: the cache changes again only after the attention's last sync.
        let n = unsafe { b.cache.get() }.layer(src).len();
        if b.split.splits(c.n_kv_heads, m.n, n) {
            self.attend_split(model, l, src, n);
        } else {
            self.attend_whole(model, l, src);
        }
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
        team_product(
            self.m,
            &[w],
            input,
            &mut self.acts,
            &[(&b.proj, &None)],
            None,
        );
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

    /// Each member its rows of the logits (soft-capped by the member that wrote them).
    fn logits(&mut self, norm: &[f32], eps: f32, lm_head: &Matrix, cap: Option<f32>) -> Result<()> {
        ops::rmsnorm(&self.x, norm, eps, &mut self.h);
        check_finite_hidden(&self.h, self.pos)?;
        let b = self.b;
        team_product(
            self.m,
            &[lm_head],
            &self.h,
            &mut self.acts,
            &[(&b.logits, &None)],
            cap,
        );
        Ok(())
    }
}

/// The buffers of one decode team step, shared by its members ([`crate::team`]). Who
/// writes what, per layer (every other access is a read of a complete buffer):
///
/// 1. each member the rows it claims of `q`, `k`, `v` — sync;
/// 2. member 0 the cache (append), `tables` (prepare) and, split, the heads' score
///    buffers' sizes and `head_probs` — sync;
/// 3. each member the KV heads it claims: their `heads` and rows of `att` — sync (split,
///    [`AttnSplit`]: each member the row ranges it claims of the heads' scores — sync;
///    each member the query heads it claims: their weights and rows of `att` — sync);
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
    /// each KV head's scores buffer in a split attention (member 0 writes them in step 2)
    head_probs: SharedSlice<'a, ProbsPtr>,
    /// when attention is split within KV heads
    split: AttnSplit,
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

/// This member's share of `outs[i] = mats[i] · x` (plus bias, then soft-capped when `cap`
/// is given: the logits), on the calling thread.
fn team_product(
    m: &Member,
    mats: &[&Matrix],
    x: &[f32],
    acts: &mut QuantizedActs,
    outs: &[(&SharedSlice<f32>, &Option<Vec<f32>>)],
    cap: Option<f32>,
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
            soft_cap(o, cap);
        })
    });
}

/// KV head `h`'s `(group, stored)` scores buffer, as member 0 sized it for a split
/// attention: `(pointer, length)`.
#[derive(Clone, Copy)]
pub(super) struct ProbsPtr(pub(super) *mut f32, pub(super) usize);

// SAFETY: a plain address into the heads' scratch; who writes where is the protocol of
// `TeamMember::attend_split`.
unsafe impl Send for ProbsPtr {}

/// Rows per range of a split attention's scoring: about four ranges per member over all
/// KV heads (a late member's share is taken by the others), a multiple of 16 rows.
pub(super) fn score_chunk(stored: usize, members: usize, n_kv_heads: usize) -> usize {
    let per_head = (4 * members).div_ceil(n_kv_heads).max(1);
    stored.div_ceil(per_head).next_multiple_of(16)
}

impl TeamMember<'_, '_, '_> {
    /// Each member whole KV heads ([`attend_heads`]).
    fn attend_whole(&mut self, model: &Model, l: usize, src: usize) {
        let (c, rope, m, b) = (&model.cfg, &model.ropes[l], self.m, self.b);
        let width = c.group() * c.head_dim;
        m.claim_each(c.n_kv_heads, |h| {
            // SAFETY: nobody changes the cache or the tables until the caller's next sync;
            // each KV head is claimed once, with its scratch and its rows of `att`.
            let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
            let hs: &mut [HeadScratch] = unsafe { b.heads.range_mut(h..h + 1) };
            let out = unsafe { b.att.range_mut(h * width..(h + 1) * width) };
            attend_heads(c, rope, cache.layer(src), tables, h, hs, out);
        });
    }

    /// Attention split within KV heads over `n` stored rows: each member scores the
    /// (KV head, row range) units it claims into the heads' score buffers — sync; then
    /// the softmax and weighted sum of each run of query heads it claims into its rows
    /// of `att`.
    fn attend_split(&mut self, model: &Model, l: usize, src: usize, n: usize) {
        let (c, rope, m, b) = (&model.cfg, &model.ropes[l], self.m, self.b);
        let (hd, group, nkv) = (c.head_dim, c.group(), c.n_kv_heads);
        // SAFETY: nobody changes the cache or the tables until the caller's next sync.
        let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
        let layer = cache.layer(src);
        // SAFETY: written by member 0 before the last sync, only read until the next step.
        let ptrs = unsafe { b.head_probs.all() };
        debug_assert!(ptrs.iter().all(|p| p.1 == group * n));
        let chunk = score_chunk(n, m.n, nkv);
        let per_head = n.div_ceil(chunk);
        let (hs, scores) = (&mut self.attn, &mut self.scores);
        m.claim_each(nkv * per_head, |u| {
            let (h, k) = (u / per_head, u % per_head);
            let rows = k * chunk..((k + 1) * chunk).min(n);
            let len = rows.len();
            scores.resize(group * len, 0.0);
            score_rows(c, rope, layer, tables, h, rows.clone(), hs, scores, len);
            for (j, s) in scores.chunks_exact(len).enumerate() {
                let at = j * n + rows.start;
                // SAFETY: the buffer holds `group * n` values (sized by member 0 before
                // the last sync); each (head, range) unit is claimed once, so these
                // ranges are written by this member alone and read after the next sync.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptrs[h].0.add(at), len) };
                dst.copy_from_slice(s);
            }
        });
        m.sync();
        // Units of `per` consecutive query heads of one KV head (Gemma 3's four on two
        // members: two each), so a member reads each value row once for its unit.
        let per = (group / m.n).max(1);
        let units = group.div_ceil(per);
        m.claim_each(nkv * units, |u| {
            let (h, j0) = (u / units, (u % units) * per);
            let j1 = (j0 + per).min(group);
            let (q0, q1) = (h * group + j0, h * group + j1);
            // SAFETY: every score is written (the sync above); each unit is claimed once,
            // with its rows of the scores and its rows of `att`.
            let p = unsafe { std::slice::from_raw_parts_mut(ptrs[h].0.add(j0 * n), (j1 - j0) * n) };
            let out = unsafe { b.att.range_mut(q0 * hd..q1 * hd) };
            mix_query_heads(c, rope, layer, tables, h, p, out);
        });
    }
}
