//! `tinygpt_cpu._native.Generation`: an iterator that holds one generation's state (its
//! cache, sampler and text) and yields one `(token_id, text, finish_reason)` per generated
//! token, computing each with the interpreter released.
//!
//! Text: each token's text is what `sample` streams for it (the library's
//! [`StreamDecoder`](tinygpt_cpu::tokenizer::StreamDecoder): a UTF-8 character split
//! across tokens comes out whole, with the token that completes it), except that a tail
//! that could be the start of a stop string is held back until the next token says
//! whether it is (as `serve` does). The last item carries the rest: the decoding of every
//! generated id, so the concatenated texts equal the text `sample --json` reports, cut
//! before the first stop string. `finish_reason` is None until the last item, then
//! `"stop"` (end-of-sequence token or stop string) or `"length"` (`max_tokens`).

use crate::model::Shared;
use crate::{catch, py_err};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use tinygpt_cpu::generate::EngineRun;
use tinygpt_cpu::server::scheduler::{find_stop, held_back};
use tinygpt_cpu::tokenizer::Tokenizer;

/// One item: the token (None only for a generation that ended without one), its text,
/// and the finish reason on the last item.
type Item = (Option<u32>, String, Option<&'static str>);

/// A generation's state between two steps.
pub(crate) struct State {
    run: EngineRun<Arc<tinygpt_cpu::model::Model>>,
    gen: tinygpt_cpu::generate::Generation,
    /// The prompt has gone through the cache.
    prefilled: bool,
    stop: Vec<String>,
    /// Every generated id (the final text is their decoding).
    ids: Vec<u32>,
    /// The text so far; `text[..sent]` has been yielded.
    text: String,
    sent: usize,
    finish: Option<&'static str>,
}

impl State {
    pub fn new(
        run: EngineRun<Arc<tinygpt_cpu::model::Model>>,
        gen: tinygpt_cpu::generate::Generation,
        stop: Vec<String>,
    ) -> State {
        State {
            run,
            gen,
            prefilled: false,
            stop,
            ids: Vec::new(),
            text: String::new(),
            sent: 0,
            finish: None,
        }
    }

    /// Computes the next token and its text (detached, by [`Shared::step`]).
    fn advance(&mut self, tok: &Tokenizer) -> tinygpt_cpu::Result<Item> {
        let Some(step) = self.gen.step(&mut self.run, tok)? else {
            return Ok((None, self.finish_with(tok, "length", false), self.finish));
        };
        self.ids.push(step.id);
        if step.eos {
            return Ok((
                Some(step.id),
                self.finish_with(tok, "stop", true),
                self.finish,
            ));
        }
        self.text.push_str(&step.text);
        if let Some(cut) = find_stop(&self.text, &self.stop) {
            let out = self.text.get(self.sent..cut).unwrap_or("").to_string();
            self.text.truncate(cut.max(self.sent));
            self.sent = self.text.len();
            self.finish = Some("stop");
            return Ok((Some(step.id), out, self.finish));
        }
        if self.gen.finished() {
            return Ok((
                Some(step.id),
                self.finish_with(tok, "length", false),
                self.finish,
            ));
        }
        let safe = self.text.len() - held_back(&self.text, &self.stop);
        let out = self.text.get(self.sent..safe).unwrap_or("").to_string();
        self.sent = self.sent.max(safe);
        Ok((Some(step.id), out, None))
    }

    /// Ends the generation with `reason`; returns the text not yielded yet: the decoding of
    /// every generated id (the end-of-sequence token excluded when `eos_last`), which
    /// extends what was yielded, cut before a stop string that appears in the rest.
    fn finish_with(&mut self, tok: &Tokenizer, reason: &'static str, eos_last: bool) -> String {
        self.finish = Some(reason);
        let ids = &self.ids[..self.ids.len() - usize::from(eos_last)];
        if let Ok(full) = tok.decode(ids) {
            if full.is_char_boundary(self.sent) && full[..self.sent] == self.text[..self.sent] {
                self.text = full;
            }
        }
        if let Some(cut) = find_stop(&self.text, &self.stop) {
            if cut >= self.sent {
                self.text.truncate(cut);
                self.finish = Some("stop");
            }
        }
        let out = self.text.get(self.sent..).unwrap_or("").to_string();
        self.sent = self.text.len().max(self.sent);
        out
    }
}

/// A generation in progress (iterate it; `tinygpt_cpu.Model` wraps the items in
/// OpenAI-shaped chunks).
#[pyclass(frozen, module = "tinygpt_cpu._native")]
pub struct Generation {
    shared: Arc<Shared>,
    state: Mutex<State>,
    prompt_tokens: usize,
    seed: u64,
}

impl Generation {
    pub(crate) fn new(
        shared: Arc<Shared>,
        state: State,
        prompt_tokens: usize,
        seed: u64,
    ) -> Generation {
        Generation {
            shared,
            state: Mutex::new(state),
            prompt_tokens,
            seed,
        }
    }

    /// The state, unless another thread is stepping this generation.
    fn state(&self) -> PyResult<std::sync::MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Ok(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "this generation is in use by another thread",
            )),
        }
    }
}

#[pymethods]
impl Generation {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next token: `(token_id, text, finish_reason)`. Pending signals (Ctrl-C) raise
    /// here, before any work; an error ends the generation.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Item>> {
        py.check_signals()?;
        let mut guard = self.state()?;
        if guard.finish.is_some() {
            return Ok(None);
        }
        let st: &mut State = &mut guard;
        let shared = &*self.shared;
        let tok = shared.tokenizer()?;
        let r = py.detach(|| {
            catch(|| {
                // The prompt in the pool (batched products fork and join there), then
                // the token as a decode step.
                if !st.prefilled {
                    shared.compute(|| st.gen.prefill(&mut st.run))?;
                    st.prefilled = true;
                }
                shared.step(|| st.advance(tok))
            })
        });
        let item = match r {
            Ok(Ok(item)) => item,
            Ok(Err(e)) => {
                st.finish = Some("error");
                return Err(py_err(e));
            }
            Err(e) => {
                st.finish = Some("error");
                return Err(e);
            }
        };
        shared.record(&st.run, st.gen.current_length());
        Ok(Some(item))
    }

    /// Prompt tokens.
    #[getter]
    fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Tokens generated so far (the end-of-sequence token included).
    #[getter]
    fn completion_tokens(&self) -> PyResult<usize> {
        Ok(self.state()?.ids.len())
    }

    /// The generated ids so far.
    #[getter]
    fn token_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.state()?.ids.clone())
    }

    /// None while running, then "stop", "length" (or "error" after an exception).
    #[getter]
    fn finish_reason(&self) -> PyResult<Option<&'static str>> {
        Ok(self.state()?.finish)
    }

    /// The sampler's seed (given, or drawn from the clock as `sample` does).
    #[getter]
    fn seed(&self) -> u64 {
        self.seed
    }

    /// Prompt tokens per second of the prefill (0 before it).
    #[getter]
    fn prefill_tok_s(&self) -> PyResult<f64> {
        let st = self.state()?;
        Ok(rate(self.prompt_tokens, st.gen.prefill_secs()))
    }

    /// Decode steps per second (forward pass and sample; 0 before the second token).
    #[getter]
    fn decode_tok_s(&self) -> PyResult<f64> {
        let st = self.state()?;
        Ok(rate(st.gen.decode_steps(), st.gen.decode_secs()))
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if n == 0 || secs <= 0.0 {
        0.0
    } else {
        n as f64 / secs
    }
}
