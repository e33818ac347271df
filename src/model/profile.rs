//! Where a decode step's time goes ([`StepProfile`], [`Model::forward_profiled`]): each
//! stage of [`Model::step`] timed as the rows strategy runs it (the one-thread decode
//! path, [`super::rows`]), by op and by weight type, with the bytes of weights it reads,
//! so `benches/decode_profile.rs` can set each op's bytes per second against a plain read
//! loop. The values are [`Model::forward`]'s on one thread, bit for bit: the wrapper only
//! reads a clock around each stage (tens of nanoseconds, against milliseconds a step).

use super::{rows, Exec, Input, Kv, Model, SeqStep, Session};
use crate::config::Config;
use crate::error::Result;
use crate::ops::Matrix;
use std::collections::BTreeMap;
use std::time::Instant;

/// One op's totals over the profiled steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTime {
    /// Stage calls timed (per step: one per layer, or one).
    pub calls: u64,
    /// Seconds spent in them.
    pub secs: f64,
    /// Weight bytes they read (each matrix's bytes in its file type, once per call).
    pub bytes: u64,
}

/// Times by op label ([`op_label`]'s: `q/k/v Q5_0+Q5_0+Q8_0`, `attention`, `o_proj Q5_0`,
/// `gate+up Q5_0`, `down Q6_K`, `head Q8_0`, `norms`), summed over the steps run with it.
#[derive(Clone, Debug, Default)]
pub struct StepProfile {
    pub ops: BTreeMap<String, OpTime>,
    /// Steps profiled.
    pub steps: u64,
}

impl StepProfile {
    fn add(&mut self, label: String, secs: f64, bytes: u64) {
        let e = self.ops.entry(label).or_default();
        e.calls += 1;
        e.secs += secs;
        e.bytes += bytes;
    }

    /// Seconds of every op together.
    pub fn total_secs(&self) -> f64 {
        self.ops.values().map(|o| o.secs).sum()
    }
}

/// `what` followed by the matrices' types joined by `+` (`gate+up Q5_0` when they agree).
fn op_label(what: &str, mats: &[&Matrix]) -> String {
    let mut types: Vec<&str> = mats.iter().map(|m| m.dtype.name()).collect();
    types.dedup();
    format!("{what} {}", types.join("+"))
}

fn bytes_of(mats: &[&Matrix]) -> u64 {
    mats.iter().map(|m| m.byte_len() as u64).sum()
}

/// An [`Exec`] that times each stage of `inner`.
struct Timed<'p, E> {
    inner: &'p mut E,
    prof: &'p mut StepProfile,
}

impl<'p, E> Timed<'p, E> {
    fn time<T>(&mut self, label: String, bytes: u64, f: impl FnOnce(&mut E) -> T) -> T {
        let t0 = Instant::now();
        let out = f(self.inner);
        self.prof.add(label, t0.elapsed().as_secs_f64(), bytes);
        out
    }
}

impl<'m, E: Exec<'m>> Exec<'m> for Timed<'_, E> {
    fn norm(&mut self, w: &'m [f32], eps: f32) {
        self.time("norms".into(), 0, |e| e.norm(w, eps))
    }

    fn project(&mut self, mats: &[&'m Matrix], biases: [&'m Option<Vec<f32>>; 3]) {
        let what = if mats.len() == 1 { "q" } else { "q/k/v" };
        self.time(op_label(what, mats), bytes_of(mats), |e| {
            e.project(mats, biases)
        })
    }

    fn check_kv(&mut self, l: usize) -> Result<()> {
        self.time("norms".into(), 0, |e| e.check_kv(l))
    }

    fn head_norms(&mut self, q_norm: &'m Option<Vec<f32>>, k_norm: &'m Option<Vec<f32>>, eps: f32) {
        self.time("norms".into(), 0, |e| e.head_norms(q_norm, k_norm, eps))
    }

    fn attend(&mut self, model: &'m Model, l: usize, kv: Kv) -> Result<()> {
        self.time("attention".into(), 0, |e| e.attend(model, l, kv))
    }

    fn residual(&mut self, w: &'m Matrix, input: Input, post_norm: &'m Option<Vec<f32>>, eps: f32) {
        let what = match input {
            Input::Att => "o_proj",
            Input::Gate => "down",
        };
        self.time(op_label(what, &[w]), bytes_of(&[w]), |e| {
            e.residual(w, input, post_norm, eps)
        })
    }

    fn gated(&mut self, c: &'m Config, w_gate: &'m Matrix, w_up: &'m Matrix) {
        let mats = [w_gate, w_up];
        self.time(op_label("gate+up", &mats), bytes_of(&mats), |e| {
            e.gated(c, w_gate, w_up)
        })
    }

    fn logits(
        &mut self,
        norm: &'m [f32],
        eps: f32,
        lm_head: &'m Matrix,
        cap: Option<f32>,
    ) -> Result<()> {
        self.time(op_label("head", &[lm_head]), bytes_of(&[lm_head]), |e| {
            e.logits(norm, eps, lm_head, cap)
        })
    }
}

impl Model {
    /// [`forward`](Self::forward) run as rows on the calling thread (the one-thread
    /// decode path), each stage timed into `prof` (module docs). The logits and the cache
    /// are what `forward` gives on one thread, bit for bit.
    pub fn forward_profiled(
        &self,
        s: &mut Session,
        token: u32,
        pos: usize,
        prof: &mut StepProfile,
    ) -> Result<()> {
        let mut steps = [SeqStep {
            session: s,
            tokens: &[token],
            start: pos,
            all_logits: None,
        }];
        prof.steps += 1;
        crate::threads::solo(|| {
            rows::run_with(self, &mut steps, |model, r| {
                model.step(&mut Timed {
                    inner: r,
                    prof: &mut *prof,
                })
            })
        })
    }
}
