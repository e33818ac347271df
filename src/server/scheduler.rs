//! The continuous-batching step loop (runs on its own thread, inside the compute pool).
//!
//! Each step:
//! 1. new jobs join (they were admitted by the handler, so their cache fits), each
//!    resumed from the prompt cache when it holds a match ([`super::prompt_cache`]: the
//!    kept cache released to the match, and the prompt prefilled from there);
//! 2. sequences whose client went away (event receiver dropped) leave;
//! 3. every decoding sequence contributes its last sampled token (and a draft, see
//!    below), and sequences still reading their prompt share
//!    [`ServerConfig::prefill_tokens_per_step`] prompt tokens (oldest first), so a long
//!    prompt is prefilled over several steps while the others keep decoding;
//! 4. one [`Model::forward_sequences`] runs them all;
//! 5. every sequence that produced logits samples its next token with its own sampler
//!    (the sequences in parallel), and finished sequences (EOS, `max_tokens`, a stop string) leave;
//!    when 16 MiB or more of cache is freed as one leaves, the memory is given back to
//!    the system ([`crate::memory::release_free_memory`]).
//!
//! With the prompt cache on (`--prompt-cache-bytes`, and the request's `cache_prompt`), a
//! sequence holds its cache's rows from the end of its prompt on ([`KvCache::hold`], within
//! [`prompt_cache::bound_hold`]'s bounds), and when it leaves for any reason but an error
//! (finished, timed out, or its client went away) its cache is offered to the prompt
//! cache before its admission is given back and its client told.
//!
//! With speculative decoding on (`serve --speculate`, the request's `speculate`), a
//! decoding sequence whose [`Speculator`] finds a draft worth verifying runs
//! `[next, d1, …, dk]` in the same batched forward, asking for every row's logits
//! ([`SeqStep::all_logits`]); its drafted rows come out of the step's prefill budget (what
//! the prompts left). Its rows are held: under the prompt cache's hold when one runs, else
//! a hold of their own (holds do not nest, docs/design.md §3.2). The drafts are checked as
//! `sample --speculate` checks them ([`speculate::check`]); the output tokens go through
//! [`accept`] one by one (EOS, stop strings and `max_tokens` end the sequence mid-output,
//! nothing after the end is emitted), and the cache keeps exactly the rows plain decoding
//! would have appended to emit the tokens taken (`rewind` of the prompt cache's hold to
//! what it held before plus those, or `release` of the pass's own hold).
//!
//! A sequence past its deadline (`--request-timeout`) leaves at the start of a step with
//! finish reason `length`; when the drain times out (`Shared::abort`) every sequence
//! leaves with an error event.
//!
//! Per sequence, this is exactly `generate`'s loop (prefill, sample, feed back), and the
//! batched forward is bit-identical to the solo one, so a greedy request returns what
//! `sample --temperature 0` prints; a resumed one too, since its cache is bit for bit the
//! cache of the rows it skips (docs/design.md §3.2).
//!
//! [`ServerConfig::prefill_tokens_per_step`]: super::ServerConfig::prefill_tokens_per_step

use super::prompt_cache::{self, Finished};
use super::{Reservation, Shared};
use crate::kv_cache::{KvCache, KvConfig};
use crate::model::{Model, SeqStep, Session};
use crate::sampler::{Sampler, SamplerConfig};
use crate::speculate::{self, SpecConfig, Speculator};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use rayon::prelude::*;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// A validated, tokenized, admitted request.
pub struct Job {
    /// The completion's id (`cmpl-N`, `chatcmpl-N`): a kept cache is found by it.
    pub id: String,
    pub prompt_ids: Vec<u32>,
    pub kv: KvConfig,
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// The request's `cache_prompt` (default true): resume from the prompt cache and
    /// keep this sequence's cache in it (when the server has one).
    pub cache_prompt: bool,
    /// The request's `speculate` (or the server's `--speculate`): prompt-lookup drafts.
    pub speculate: Option<SpecConfig>,
    pub reservation: Reservation,
    pub events: UnboundedSender<Event>,
    /// `--request-timeout` after admission: the sequence ends then with `length`.
    pub deadline: Option<Instant>,
}

/// Why a sequence ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the scheduler tells a handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New text (never splits a UTF-8 character; held back while it could be the start
    /// of a stop string).
    Text(String),
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens resumed from the prompt cache instead of prefilled.
        cached_tokens: usize,
    },
    Error(String),
}

/// One sequence in the batch.
struct Seq {
    job: Job,
    session: Session,
    sampler: Sampler,
    /// Prompt tokens already run (or resumed from the prompt cache).
    prefilled: usize,
    /// Prompt tokens resumed from the prompt cache.
    reused: usize,
    /// Whether this sequence holds its generated rows and is offered to the prompt cache
    /// when it ends.
    keep: bool,
    /// Position of the next token fed to the model.
    pos: usize,
    /// The token sampled last, to be fed at `pos` (decoding sequences).
    next: u32,
    generated: Vec<u32>,
    decoder: StreamDecoder,
    /// Text of `generated` so far, and how much of it was sent.
    text: String,
    sent: usize,
    /// Drafting state when the request speculates ([`crate::speculate`]).
    spec: Option<Speculator>,
    /// This step's verification pass, `[next, d1, …, dk]` (empty: a plain step).
    pass: Vec<u32>,
    /// The pass's logits, `(k + 1, vocab)`.
    pass_logits: Vec<f32>,
    /// Rows the cache held when the pass began (the prompt cache's hold: the pass's rows
    /// are held under it and rewound), or `None` (the pass holds its rows itself).
    held_before: Option<usize>,
}

/// Runs until the job channel is closed and every sequence has finished.
pub fn run(model: &Model, shared: &Shared, jobs: std::sync::mpsc::Receiver<Job>) {
    let m = &shared.metrics;
    let mut seqs: Vec<Seq> = Vec::new();
    let mut gauges = Gauges::default();
    loop {
        if seqs.is_empty() {
            gauges.idle(m);
            trim_when_idle();
            match jobs.recv() {
                Ok(j) => seqs.push(start(model, shared, j)),
                Err(_) => return,
            }
        }
        while let Ok(j) = jobs.try_recv() {
            seqs.push(start(model, shared, j));
        }
        let mut i = 0;
        while i < seqs.len() {
            if seqs[i].job.events.is_closed() {
                m.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                freed(leave(shared, seqs.remove(i), None));
            } else {
                i += 1;
            }
        }
        if shared.abort.load(Ordering::SeqCst) {
            for s in seqs.drain(..) {
                let e = "the server is shutting down and its drain timeout passed";
                freed(leave(shared, s, Some(Event::Error(e.into()))));
            }
            continue;
        }
        expire(&mut seqs, shared);
        if seqs.is_empty() {
            continue;
        }
        let Some(produced) = step(model, shared, &mut seqs) else {
            continue;
        };
        gauges.after_step(m, &seqs, produced);
    }
}

/// Once sequences leaving (and the prompt-cache entries they displace) have freed this
/// much cache memory since the last time, the free pages go back to the system
/// ([`crate::memory::release_free_memory`], a millisecond or so). Counted over many small
/// caches too: a prompt cache that evicts a 3 MiB entry per request otherwise leaves the
/// freed pages resident, scattered over the allocator's arenas (docs/eval/prompt-cache.md:
/// RSS 20–25 MiB above the entries and the running sequences after 200 requests).
const TRIM_AFTER_CACHE_BYTES: usize = 4 << 20;

thread_local! {
    /// Cache bytes freed on this scheduler thread since the last trim.
    static FREED_SINCE_TRIM: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts `bytes` of cache memory freed; past [`TRIM_AFTER_CACHE_BYTES`] since the last
/// trim, gives the free pages back.
fn freed(bytes: usize) {
    let total = FREED_SINCE_TRIM.with(|f| f.get()).saturating_add(bytes);
    if total >= TRIM_AFTER_CACHE_BYTES {
        FREED_SINCE_TRIM.with(|f| f.set(0));
        crate::memory::release_free_memory();
    } else {
        FREED_SINCE_TRIM.with(|f| f.set(total));
    }
}

/// Before the scheduler waits for work with nothing running: gives back the pages freed
/// since the last trim (fewer than [`TRIM_AFTER_CACHE_BYTES`]), so an idle server holds its
/// prompt cache's entries and little more.
fn trim_when_idle() {
    if FREED_SINCE_TRIM.with(|f| f.replace(0)) > 0 {
        crate::memory::release_free_memory();
    }
}

/// Sequences past their deadline (`--request-timeout`) leave with finish reason `length`.
fn expire(seqs: &mut Vec<Seq>, shared: &Shared) {
    let m = &shared.metrics;
    let now = Instant::now();
    let mut i = 0;
    while i < seqs.len() {
        if seqs[i].job.deadline.is_some_and(|d| now >= d) {
            let mut s = seqs.remove(i);
            flush_final(&mut s, &shared.tokenizer, false);
            m.requests_timed_out.fetch_add(1, Ordering::Relaxed);
            m.requests_finished.fetch_add(1, Ordering::Relaxed);
            let done = Event::Done {
                reason: FinishReason::Length,
                prompt_tokens: s.job.prompt_ids.len(),
                completion_tokens: s.generated.len(),
                cached_tokens: s.reused,
            };
            freed(leave(shared, s, Some(done)));
        } else {
            i += 1;
        }
    }
}

/// One step: every sequence's tokens through one batched forward, then the sampling;
/// finished sequences leave. Returns the tokens generated, `None` when the forward failed
/// (the sequences of the step then left with the error).
fn step(model: &Model, shared: &Shared, seqs: &mut Vec<Seq>) -> Option<usize> {
    let m = &shared.metrics;
    let ran = match forward(model, shared, seqs) {
        Ok(ran) => ran,
        Err((ran, e)) => {
            // A model-level failure concerns every sequence of the step.
            let failed: Vec<usize> = ran.iter().map(|&(i, _)| i).collect();
            for &i in &failed {
                let _ = seqs[i].job.events.send(Event::Error(e.to_string()));
            }
            let mut idx = 0;
            seqs.retain(|_| {
                idx += 1;
                !failed.contains(&(idx - 1))
            });
            return None;
        }
    };
    // Which sequences have logits to sample from (their prompt is all read).
    let mut sample_now = vec![false; seqs.len()];
    for &(i, n) in &ran {
        let s = &mut seqs[i];
        let prompt_len = s.job.prompt_ids.len();
        if s.prefilled < prompt_len {
            s.prefilled += n;
            m.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
            if s.prefilled < prompt_len {
                continue;
            }
            s.pos = prompt_len;
            if s.keep {
                // What it generates from here is held, so that a later request can
                // resume from any point of it (prompt_cache).
                s.session.cache.hold();
                prompt_cache::bound_hold(&mut s.session.cache, shared.cfg.prompt_cache_bytes);
            }
        } else if s.pass.is_empty() {
            s.pos += 1;
            if s.keep {
                prompt_cache::bound_hold(&mut s.session.cache, shared.cfg.prompt_cache_bytes);
            }
        }
        // A verification pass moves `pos` and settles its hold once checked (`settle`).
        sample_now[i] = true;
    }
    let produced = sample(seqs, &sample_now, shared);
    m.tokens_generated
        .fetch_add(produced as u64, Ordering::Relaxed);
    m.steps.fetch_add(1, Ordering::Relaxed);
    Some(produced)
}

/// Which tokens each sequence runs this step, run through one
/// [`Model::forward_sequences`]: sequences still reading their prompt share the prefill
/// budget, oldest first; every decoding sequence runs its last sampled token, followed,
/// when it speculates and a draft is worth it ([`plan_pass`]), by a draft whose tokens
/// come out of what the prompts left of the budget. Returns (sequence index, tokens run)
/// per sequence that ran, with the error if the forward failed.
#[allow(clippy::type_complexity)]
fn forward(
    model: &Model,
    shared: &Shared,
    seqs: &mut [Seq],
) -> Result<Vec<(usize, usize)>, (Vec<(usize, usize)>, crate::Error)> {
    let mut budget = shared.cfg.prefill_tokens_per_step.max(1);
    let mut takes = vec![0usize; seqs.len()];
    for (take, s) in takes.iter_mut().zip(seqs.iter()) {
        let prompt_left = s.job.prompt_ids.len() - s.prefilled;
        *take = prompt_left.min(budget);
        budget -= *take;
    }
    // `--speculate-max-batch`: no drafts in a step that decodes more sequences.
    let decoding = seqs
        .iter()
        .filter(|s| s.prefilled == s.job.prompt_ids.len())
        .count();
    let may_draft = decoding <= shared.cfg.speculate_max_batch;
    for s in seqs.iter_mut() {
        if s.prefilled == s.job.prompt_ids.len() {
            plan_pass(s, &mut budget, may_draft);
        }
    }
    let mut ran: Vec<(usize, usize)> = Vec::new();
    let mut steps: Vec<SeqStep<'_>> = Vec::new();
    for (i, (s, &take)) in seqs.iter_mut().zip(&takes).enumerate() {
        let Seq {
            job,
            session,
            prefilled,
            pos,
            next,
            pass,
            pass_logits,
            ..
        } = s;
        let (tokens, start, all_logits) = if *prefilled < job.prompt_ids.len() {
            if take == 0 {
                continue;
            }
            (
                &job.prompt_ids[*prefilled..*prefilled + take],
                *prefilled,
                None,
            )
        } else if pass.is_empty() {
            (std::slice::from_ref(&*next), *pos, None)
        } else {
            (&pass[..], *pos, Some(pass_logits))
        };
        ran.push((i, tokens.len()));
        steps.push(SeqStep {
            session,
            tokens,
            start,
            all_logits,
        });
    }
    match model.forward_sequences(&mut steps) {
        Ok(()) => Ok(ran),
        Err(e) => Err((ran, e)),
    }
}

/// A decoding sequence that speculates: the draft its [`Speculator`] finds worth verifying
/// now (within the tokens `max_tokens` leaves after the next one, and within `budget`, the
/// step's prefill budget, which its drafted rows use up), as this step's pass
/// `[next, draft…]`; its rows are held, under the hold already running (the prompt
/// cache's) or a hold of their own. Nothing for a plain step, and nothing (the
/// [`Speculator`] not consulted, so no back-off starts) when `may_draft` is false: the
/// step decodes more sequences than `--speculate-max-batch`.
fn plan_pass(s: &mut Seq, budget: &mut usize, may_draft: bool) {
    s.pass.clear();
    let Some(spec) = s.spec.as_mut().filter(|_| may_draft) else {
        return;
    };
    let left = s.job.max_tokens.saturating_sub(s.generated.len() + 1);
    let draft = match spec.draft_len(left.min(*budget)) {
        0 => return,
        k => spec.draft(k),
    };
    if draft.is_empty() {
        return;
    }
    *budget -= draft.len();
    s.pass.push(s.next);
    s.pass.extend_from_slice(&draft);
    s.held_before = s.session.cache.held();
    if s.held_before.is_none() {
        s.session.cache.hold();
    }
}

/// After a verification pass whose first `taken` output tokens were accepted (the rest,
/// if any, cut by the sequence's end): keeps the rows plain decoding would have appended
/// to emit them (`next` and every taken token but the last), as `sample` does
/// (docs/design.md §3.3), rewinding the prompt cache's hold or releasing the pass's own;
/// counts the pass. The sequence's `logits` are those after the last kept row.
fn settle(s: &mut Seq, taken: usize, produced: usize, accepted: usize, shared: &Shared) {
    let drafted = s.pass.len() - 1;
    let cache = &mut s.session.cache;
    match s.held_before.take() {
        Some(h) => cache.rewind(h + taken),
        None => cache.release(taken),
    }
    let vocab = s.pass_logits.len() / s.pass.len();
    s.session
        .logits
        .copy_from_slice(&s.pass_logits[(taken - 1) * vocab..taken * vocab]);
    s.pos += taken;
    s.pass.clear();
    if let Some(spec) = s.spec.as_mut() {
        spec.record(drafted, accepted);
        spec.forward_done(produced);
    }
    let m = &shared.metrics;
    m.speculate_drafted
        .fetch_add(drafted as u64, Ordering::Relaxed);
    m.speculate_accepted
        .fetch_add(accepted as u64, Ordering::Relaxed);
    m.speculate_passes.fetch_add(1, Ordering::Relaxed);
    if s.keep {
        prompt_cache::bound_hold(&mut s.session.cache, shared.cfg.prompt_cache_bytes);
    }
}

/// What a sequence's logits give this step: the tokens and how many drafts were accepted,
/// or an error message.
type Picked = Result<(Vec<u32>, usize), String>;

/// The tokens a sequence's logits give this step, and how many drafts were accepted: a
/// plain step samples its one row; a verification pass checks its draft
/// ([`speculate::check`], as `sample` does).
fn pick(s: &mut Seq, tok: &Tokenizer) -> Picked {
    if s.pass.is_empty() {
        if s.session.logits.iter().any(|x| !x.is_finite()) {
            return Err(format!(
                "the model produced non-finite logits at position {}",
                s.pos - 1
            ));
        }
        if let Some(spec) = s.spec.as_mut() {
            spec.forward_done(1);
        }
        return Ok((vec![s.sampler.sample(&s.session.logits)], 0));
    }
    let ignore_eos = s.job.ignore_eos;
    let ends = |t| tok.is_eos(t) && !ignore_eos;
    speculate::check(&mut s.sampler, &s.pass_logits, &s.pass[1..], s.pos, ends)
        .map_err(|e| e.to_string())
}

/// Every sequence in `now` checks and samples its logits, or checks its verification
/// pass's draft (a pass or more over the vocabulary each: in parallel, they share
/// nothing), and takes the tokens in order until one ends it; a pass then keeps the rows
/// of the tokens taken ([`settle`]); finished sequences leave, and a large cache's memory
/// is given back. Returns the tokens taken.
fn sample(seqs: &mut Vec<Seq>, now: &[bool], shared: &Shared) -> usize {
    let m = &shared.metrics;
    let tok = &shared.tokenizer;
    let picks: Vec<Option<Picked>> = seqs
        .par_iter_mut()
        .zip(now)
        .map(|(s, &now)| now.then(|| pick(s, tok)))
        .collect();
    let mut produced = 0usize;
    let mut finished: Vec<(usize, Event)> = Vec::new();
    for (i, pick) in picks.into_iter().enumerate() {
        match pick {
            None => {}
            Some(Err(e)) => finished.push((i, Event::Error(e))),
            Some(Ok((out, accepted))) => {
                let s = &mut seqs[i];
                let mut taken = 0;
                let mut done = None;
                for &t in &out {
                    taken += 1;
                    done = accept(s, t, tok);
                    if done.is_some() {
                        break;
                    }
                }
                produced += taken;
                if !s.pass.is_empty() {
                    settle(s, taken, out.len(), accepted, shared);
                }
                if let Some(done) = done {
                    m.requests_finished.fetch_add(1, Ordering::Relaxed);
                    finished.push((i, done));
                }
            }
        }
    }
    // Leave the batch, give the admission back, then tell the client: a client that
    // sends its next request on seeing the end finds the slot free (and its cache kept).
    for (i, last) in finished.into_iter().rev() {
        freed(leave(shared, seqs.remove(i), Some(last)));
    }
    produced
}

/// The scheduler's gauges in [`super::metrics::Metrics`].
#[derive(Default)]
struct Gauges {
    /// (end of step, tokens generated in it), last ~2 s, for the tok/s gauge.
    recent: VecDeque<(Instant, usize)>,
}

impl Gauges {
    /// Nothing runs.
    fn idle(&mut self, m: &super::metrics::Metrics) {
        m.set_decode_tok_s(0.0);
        m.active.store(0, Ordering::Relaxed);
        m.prefilling.store(0, Ordering::Relaxed);
        m.kv_bytes_in_use.store(0, Ordering::Relaxed);
        m.prompt_cache_hold_bytes.store(0, Ordering::Relaxed);
        self.recent.clear();
    }

    /// After a step that generated `produced` tokens.
    fn after_step(&mut self, m: &super::metrics::Metrics, seqs: &[Seq], produced: usize) {
        let now = Instant::now();
        let recent = &mut self.recent;
        recent.push_back((now, produced));
        while recent
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) > Duration::from_secs(2))
        {
            recent.pop_front();
        }
        if let (Some(&(first, _)), true) = (recent.front(), recent.len() > 1) {
            let secs = now.duration_since(first).as_secs_f64();
            let toks: usize = recent.iter().skip(1).map(|&(_, n)| n).sum();
            if secs > 0.0 {
                m.set_decode_tok_s(toks as f64 / secs);
            }
        }
        let prefilling = seqs
            .iter()
            .filter(|s| s.prefilled < s.job.prompt_ids.len())
            .count();
        m.prefilling.store(prefilling as u64, Ordering::Relaxed);
        m.active
            .store((seqs.len() - prefilling) as u64, Ordering::Relaxed);
        let bytes: usize = seqs.iter().map(|s| s.session.cache.bytes()).sum();
        m.kv_bytes_in_use.store(bytes as u64, Ordering::Relaxed);
        let held: usize = seqs.iter().map(|s| s.session.cache.hold_bytes()).sum();
        m.prompt_cache_hold_bytes
            .store(held as u64, Ordering::Relaxed);
    }
}

/// A sequence leaves the batch: unless it ends with an error, its cache is offered to
/// the prompt cache; its admission is given back; then the client is told `last`, if
/// still there (so a client that sends its next request on seeing the end finds the
/// slot free and the cache kept). Returns the cache bytes freed.
fn leave(shared: &Shared, s: Seq, last: Option<Event>) -> usize {
    let Seq {
        job,
        session,
        generated,
        keep,
        ..
    } = s;
    let freed = match keep && !matches!(last, Some(Event::Error(_))) {
        true => offer(shared, &job, &generated, session.cache),
        false => session.cache.bytes() + session.cache.hold_bytes(),
    };
    let Job {
        events,
        reservation,
        ..
    } = job;
    drop(reservation);
    if let Some(last) = last {
        let _ = events.send(last);
    }
    freed
}

/// Offers a finished sequence's cache to the prompt cache; returns the bytes freed (the
/// entries it displaced, or this cache when it is not kept).
fn offer(shared: &Shared, job: &Job, generated: &[u32], cache: KvCache) -> usize {
    let Some(ids) = prompt_cache::fed_ids(&job.prompt_ids, generated, &cache) else {
        return cache.bytes() + cache.hold_bytes();
    };
    let finished = Finished {
        kv: job.kv.clone(),
        worst_case: shared.worst_case_bytes(&job.kv, ids.len()),
        ids,
        cache,
        completion: job.id.clone(),
    };
    let mut pc = shared.prompt_cache();
    let freed = pc.insert(finished).freed;
    shared.metrics.set_prompt_cache(&pc);
    freed
}

/// A new sequence: resumed from the prompt cache when it holds a match, else empty.
fn start(model: &Model, shared: &Shared, job: Job) -> Seq {
    let mut session = model.session(&job.kv);
    let keep = job.cache_prompt && shared.cfg.prompt_cache_bytes > 0;
    let mut reused = 0;
    if keep {
        let m = &shared.metrics;
        let hit = shared.prompt_cache().lookup(&job.kv, &job.prompt_ids);
        match hit {
            Some(r) => {
                session.cache = r.cache;
                reused = r.reused;
                m.prompt_cache_hits.fetch_add(1, Ordering::Relaxed);
                m.prompt_cache_reused_tokens
                    .fetch_add(reused as u64, Ordering::Relaxed);
            }
            None => {
                m.prompt_cache_misses.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Seq {
        session,
        sampler: Sampler::new(job.sampler.clone()),
        prefilled: reused,
        reused,
        keep,
        pos: 0,
        next: 0,
        generated: Vec::new(),
        decoder: StreamDecoder::new(),
        text: String::new(),
        sent: 0,
        spec: job.speculate.map(|c| Speculator::new(c, &job.prompt_ids)),
        pass: Vec::new(),
        pass_logits: Vec::new(),
        held_before: None,
        job,
    }
}

/// Takes sampled token `t` as `generate` does; sends the new text. Returns the final
/// event when the sequence is finished.
fn accept(s: &mut Seq, t: u32, tok: &Tokenizer) -> Option<Event> {
    s.generated.push(t);
    if let Some(spec) = s.spec.as_mut() {
        spec.context.push(t);
    }
    let done = |s: &Seq, reason| Event::Done {
        reason,
        prompt_tokens: s.job.prompt_ids.len(),
        completion_tokens: s.generated.len(),
        cached_tokens: s.reused,
    };
    if tok.is_eos(t) && !s.job.ignore_eos {
        flush_final(s, tok, true);
        return Some(done(s, FinishReason::Stop));
    }
    match s.decoder.push(tok, t) {
        Ok(delta) => s.text.push_str(&delta),
        Err(e) => return Some(Event::Error(e.to_string())),
    }
    if let Some(cut) = find_stop(&s.text, &s.job.stop) {
        if cut > s.sent {
            let _ = s
                .job
                .events
                .send(Event::Text(s.text[s.sent..cut].to_string()));
        }
        s.sent = cut;
        s.text.truncate(cut);
        return Some(done(s, FinishReason::Stop));
    }
    if s.generated.len() >= s.job.max_tokens {
        flush_final(s, tok, false);
        return Some(done(s, FinishReason::Length));
    }
    s.next = t;
    let safe = s.text.len() - held_back(&s.text, &s.job.stop);
    if safe > s.sent {
        let _ = s
            .job
            .events
            .send(Event::Text(s.text[s.sent..safe].to_string()));
        s.sent = safe;
    }
    None
}

/// At the end, the text is the decoding of every generated id (EOS excluded), as
/// `generate` returns it; sends whatever of it was not sent yet.
fn flush_final(s: &mut Seq, tok: &Tokenizer, eos_last: bool) {
    let ids = if eos_last {
        &s.generated[..s.generated.len() - 1]
    } else {
        &s.generated[..]
    };
    if let Ok(full) = tok.decode(ids) {
        if full.is_char_boundary(s.sent) && full[..s.sent] == s.text[..s.sent] {
            s.text = full;
        }
    }
    if s.text.len() > s.sent {
        let _ = s.job.events.send(Event::Text(s.text[s.sent..].to_string()));
        s.sent = s.text.len();
    }
}

/// Byte offset where the first stop string starts in `text`, if any occurs.
pub fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// Length of the longest tail of `text` that is a proper prefix of a stop string: that
/// much is held back until the next token says whether the stop string follows.
pub fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for m in (1..s.len()).rev() {
            if m <= hold {
                break;
            }
            if s.is_char_boundary(m) && text.as_bytes().ends_with(&s.as_bytes()[..m]) {
                hold = m;
                break;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(find_stop("abc\n\nxEND", &stops), Some(3));
        assert_eq!(find_stop("abcEN", &stops), None);
        assert_eq!(held_back("abcEN", &stops), 2);
        assert_eq!(held_back("abc\n", &stops), 1);
        assert_eq!(held_back("abcE N", &stops), 0);
        assert_eq!(held_back("é", &["éa".to_string()]), 2);
    }
}
