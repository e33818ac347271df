//! `tinygpt_cpu._native.Model`: a model loaded once, with its cache settings, thread pool
//! and tokenizer; every run (a generation, `eval_logits`, `perplexity`) starts a fresh cache.
//!
//! The Python layer passes options as the CLI flags they stand for (`["--kv-quantize",
//! "int4", ...]`); they are parsed by the CLI's clap definitions and checked by the
//! functions `sample` and `perplexity` call, in the same order, so errors carry the CLI's
//! messages.

use crate::generation::{Generation, State};
use crate::{catch, flag_err, json, py_err};
use clap::Parser;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tinygpt_cpu::cli::common::{CacheArgs, EngineArgs, Loaded};
use tinygpt_cpu::cli::perplexity::{self as ppl_cli, PerplexityArgs};
use tinygpt_cpu::cli::sample::{self as sample_cli, SampleArgs};
use tinygpt_cpu::generate::{check_finite, Engine, EngineRun, GenerateOptions};
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::weights::ModelFiles;
use tinygpt_cpu::Error;

/// The cache and engine flags of a model (the CLI's `CacheArgs` and `EngineArgs`).
#[derive(Parser)]
#[command(name = "tinygpt_cpu.Model", no_binary_name = true)]
struct ModelFlags {
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// A generation's flags, as `sample` takes them.
#[derive(Parser)]
#[command(name = "tinygpt_cpu", no_binary_name = true)]
struct SampleFlags {
    #[command(flatten)]
    a: SampleArgs,
}

/// A perplexity run's flags, as `perplexity` takes them.
#[derive(Parser)]
#[command(name = "tinygpt_cpu", no_binary_name = true)]
struct PerplexityFlags {
    #[command(flatten)]
    a: PerplexityArgs,
}

/// What the model's runs share.
pub(crate) struct Shared {
    pub model: Arc<tinygpt_cpu::model::Model>,
    /// Config, tokenizer, chat template and path (tensors dropped once loaded).
    pub files: ModelFiles,
    /// The flags the model was opened with, given again to each run's `SampleArgs` /
    /// `PerplexityArgs`.
    flags: Vec<String>,
    pub kv: KvConfig,
    pool: rayon::ThreadPool,
    /// Whether decode steps run on the calling thread ([`Shared::step`]): when rayon
    /// gives a thread outside any pool as many threads as the model's pool has.
    here: bool,
    /// Held while the pool computes: it runs one step at a time (two decode teams
    /// broadcast on one pool would wait for each other's members).
    busy: Mutex<()>,
    /// The last run's cache: stored rows, current length, bytes.
    last: Mutex<[usize; 3]>,
}

/// Held while a decode step runs on a calling thread ([`Shared::step`]): one at a time in
/// the process, as two barrier-team steps broadcast on rayon's global pool at once would
/// wait for each other's members.
static HERE: Mutex<()> = Mutex::new(());

impl Shared {
    /// The model's tokenizer ([`Model::new`] waited for its build and refused a model
    /// whose tokenizer could not be built).
    pub fn tokenizer(&self) -> PyResult<&tinygpt_cpu::tokenizer::Tokenizer> {
        self.files.tokenizer().map_err(py_err)
    }

    /// Runs `f` on the model's pool, after any step another thread is running there (a
    /// prefill: its parallel regions fork and join inside the pool). Called detached
    /// from the interpreter.
    pub fn compute<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let _turn = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.pool.install(f)
    }

    /// Runs one decode step `f` (a forward pass of one token), detached from the
    /// interpreter: on the calling thread when that gives the kernels the model's thread
    /// count, else on the model's pool. On the calling thread a step runs as `sample`'s
    /// do on their pool thread: alone, or as a relay team whose first member is the
    /// calling thread; a pool would add two thread wake-ups per token (measured at about
    /// 1 ms each on a machine busy with other work, 10% of a SmolLM2 token).
    ///
    /// A one-thread model's step runs on the calling thread too, with every kernel there
    /// ([`threads::solo`](tinygpt_cpu::threads::solo): what a one-thread pool would do,
    /// without handing each token to the pool's thread and back); it still takes the
    /// model's turn, so a one-thread model computes on one core at a time.
    pub fn step<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        if self.here {
            let _turn = HERE.lock().unwrap_or_else(|e| e.into_inner());
            f()
        } else if self.pool.current_num_threads() == 1 {
            let _turn = self.busy.lock().unwrap_or_else(|e| e.into_inner());
            tinygpt_cpu::threads::solo(f)
        } else {
            self.compute(f)
        }
    }

    /// Notes what `run`'s cache holds after `current_length` tokens (for `Model.kv`).
    pub fn record(&self, run: &dyn Engine, current_length: usize) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        *last = [run.stored_tokens(), current_length, run.kv_bytes()];
    }

    /// `argv` after the model's flags, parsed as `sample` would parse them.
    fn sample_args(&self, argv: &[String]) -> PyResult<SampleArgs> {
        let all = argv.iter().chain(&self.flags);
        SampleFlags::try_parse_from(all)
            .map(|f| f.a)
            .map_err(flag_err)
    }

    /// The generation settings of `a` (the sampler validated) and its seed.
    fn options(&self, a: &SampleArgs) -> PyResult<(GenerateOptions, u64)> {
        sample_cli::options(a, &self.files, &self.kv).map_err(py_err)
    }

    /// Refuses ids outside the model's vocabulary.
    fn check_ids(&self, ids: &[u32], what: &str) -> PyResult<()> {
        let vocab = self.model.cfg.vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(PyValueError::new_err(format!(
                "{what}: token id {t} is outside the model's vocabulary ({vocab})"
            ))),
            None => Ok(()),
        }
    }
}

/// A prompt: text, or token ids.
#[derive(FromPyObject)]
pub(crate) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// A loaded model (`tinygpt_cpu.Model` wraps it).
#[pyclass(frozen, module = "tinygpt_cpu._native")]
pub struct Model {
    shared: Arc<Shared>,
}

#[pymethods]
impl Model {
    /// Opens `path` (None: the bundled model) with the cache and engine `flags`.
    #[new]
    #[pyo3(signature = (path, flags))]
    fn new(py: Python<'_>, path: Option<PathBuf>, flags: Vec<String>) -> PyResult<Model> {
        let parsed = ModelFlags::try_parse_from(&flags).map_err(flag_err)?;
        let kv = parsed.cache.kv_config().map_err(py_err)?;
        let pool = parsed.engine.thread_pool().map_err(py_err)?;
        let engine = parsed.engine;
        let (files, model) = py.detach(|| {
            catch(|| {
                pool.install(|| -> tinygpt_cpu::Result<_> {
                    let mut files = ModelFiles::open(path.as_deref())?;
                    tinygpt_cpu::kv_cache::validate(&kv, &files.config)?;
                    // The weights load while the tokenizer is being built.
                    let model = Loaded::load(&files, &engine)
                        .and_then(|l| l.into_optimized("the Python package"))
                        .and_then(|m| files.tokenizer().map(|_| m))
                        .map_err(|e| files.tokenizer_error_or(e))?;
                    // The engine holds what it needs of the weights.
                    files.tensors.clear();
                    Ok((files, model))
                })
            })?
            .map_err(py_err)
        })?;
        let here = pool.current_num_threads() == rayon::current_num_threads();
        Ok(Model {
            shared: Arc::new(Shared {
                model: Arc::new(model),
                files,
                flags,
                kv,
                pool,
                here,
                busy: Mutex::new(()),
                last: Mutex::new([0; 3]),
            }),
        })
    }

    /// The model's path as given (`<bundled>` for the bundled model).
    #[getter]
    fn path(&self) -> String {
        self.shared.files.path.display().to_string()
    }

    /// Vocabulary size (logits per position).
    #[getter]
    fn n_vocab(&self) -> usize {
        self.shared.model.cfg.vocab_size
    }

    /// The model's context length (`max_position_embeddings`).
    #[getter]
    fn n_ctx(&self) -> usize {
        self.shared.model.cfg.max_position_embeddings
    }

    /// The model's chat template, if it has one.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.shared.files.chat_template.clone()
    }

    /// The end-of-sequence ids.
    #[getter]
    fn eos_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.shared.tokenizer()?.eos_ids.clone())
    }

    /// The cache settings and what the last run's cache held (`sample --json`'s `kv`).
    #[getter]
    fn kv<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = &self.shared;
        let [stored, current, bytes] = *s.last.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = &s.model.cfg;
        let v = sample_cli::kv_json(
            &s.kv,
            cfg.head_dim,
            cfg.layers_with_kv(),
            stored,
            current,
            bytes,
        );
        json::to_py(py, &v)
    }

    /// The tokenizer's encoding of `text` (with the special tokens it adds, such as a BOS,
    /// unless `add_special_tokens` is false).
    #[pyo3(signature = (text, add_special_tokens = true))]
    fn tokenize(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let tok = self.shared.tokenizer()?;
        py.detach(|| catch(|| tok.encode_with(text, add_special_tokens)))?
            .map_err(py_err)
    }

    /// The text of `ids` (special tokens skipped).
    fn detokenize(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<String> {
        self.shared.check_ids(&ids, "ids")?;
        let tok = self.shared.tokenizer()?;
        py.detach(|| catch(|| tok.decode(&ids)))?.map_err(py_err)
    }

    /// `messages` (role, content) rendered with the model's chat template, ready for the
    /// assistant's reply.
    fn render_chat(&self, messages: Vec<(String, String)>) -> PyResult<String> {
        let files = &self.shared.files;
        let Some(template) = files.chat_template.as_deref() else {
            // `sample --chat`'s refusal, word for word.
            let a = self
                .shared
                .sample_args(&["--prompt=".into(), "--chat".into()])?;
            let e = sample_cli::prompt_text(&a, files)
                .err()
                .unwrap_or_else(|| Error::Generate("the model has no chat template".into()));
            return Err(py_err(e));
        };
        let messages: Vec<BTreeMap<String, minijinja::Value>> = messages
            .into_iter()
            .map(|(role, content)| {
                BTreeMap::from([
                    ("role".to_string(), minijinja::Value::from(role)),
                    ("content".to_string(), minijinja::Value::from(content)),
                ])
            })
            .collect();
        let (bos, eos) = tinygpt_cpu::chat::special_tokens(self.shared.tokenizer()?);
        tinygpt_cpu::chat::render_messages(template, &messages, true, &bos, &eos).map_err(py_err)
    }

    /// A generation after `prompt`: `flags` are `sample`'s sampling flags (`--temperature`,
    /// `--top-k`, `--top-p`, `--seed`, `--ignore-eos`); `max_tokens` None means up to the
    /// context length; `chat` says the text is a rendered chat (encoded without added
    /// special tokens, as `sample --chat`).
    #[pyo3(signature = (prompt, flags, max_tokens, stop, chat))]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: Prompt,
        flags: Vec<String>,
        max_tokens: Option<usize>,
        stop: Vec<String>,
        chat: bool,
    ) -> PyResult<Generation> {
        let s = &self.shared;
        let (text, given_ids) = match prompt {
            Prompt::Text(t) => (t, None),
            Prompt::Ids(ids) => (String::new(), Some(ids)),
        };
        let argv = |tokens: usize| {
            let mut v = flags.clone();
            v.extend(["--prompt".into(), text.clone(), "--tokens".into()]);
            v.push(tokens.to_string());
            if chat {
                v.push("--chat".into());
            }
            v
        };
        let mut a = s.sample_args(&argv(max_tokens.unwrap_or(1)))?;
        let (mut opts, mut seed) = s.options(&a)?;
        let ids = match given_ids {
            Some(ids) => {
                s.check_ids(&ids, "prompt")?;
                opts.check_prompt(ids.len()).map_err(py_err)?;
                ids
            }
            None => py
                .detach(|| {
                    catch(|| {
                        // A chat arrives rendered (`render_chat`); `sample` renders its one
                        // message with the same template.
                        let text = if chat {
                            text.clone()
                        } else {
                            sample_cli::prompt_text(&a, &s.files)?
                        };
                        sample_cli::prompt_ids(&a, &s.files, &opts, &text)
                    })
                })?
                .map_err(py_err)?,
        };
        if max_tokens.is_none() {
            // Up to the context length (as `serve` does without max_tokens).
            let n = s
                .model
                .cfg
                .max_position_embeddings
                .saturating_sub(ids.len());
            a = s.sample_args(&argv(n.max(1)))?;
            (opts, seed) = s.options(&a)?;
            opts.check_prompt(ids.len()).map_err(py_err)?;
        }
        sample_cli::check_kv_fits(&a, &s.files, &s.kv, ids.len()).map_err(py_err)?;
        let gen = tinygpt_cpu::generate::Generation::new(&ids, &opts).map_err(py_err)?;
        let run = EngineRun::new(Arc::clone(&s.model), &s.kv);
        Ok(Generation::new(
            Arc::clone(s),
            State::new(run, gen, stop),
            ids.len(),
            seed,
        ))
    }

    /// Logits at every position of `ids`, run one token at a time through a fresh cache
    /// configured as the model is: a float32 array `(len(ids), n_vocab)`.
    fn eval_logits<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
    ) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let s = &self.shared;
        let n = ids.len();
        if n == 0 {
            return Err(PyValueError::new_err("ids: must not be empty"));
        }
        s.check_ids(&ids, "ids")?;
        // The checks of a run that reads `n` prompt tokens and generates none.
        let a = s.sample_args(&[
            "--prompt".into(),
            String::new(),
            "--tokens".into(),
            "0".into(),
        ])?;
        let (opts, _) = s.options(&a)?;
        opts.check_prompt(n).map_err(py_err)?;
        sample_cli::check_kv_fits(&a, &s.files, &s.kv, n).map_err(py_err)?;
        let vocab = s.model.cfg.vocab_size;
        let out_bytes = n as u128 * vocab as u128 * 4;
        tinygpt_cpu::memory::check_fits(out_bytes)
            .map_err(|m| PyValueError::new_err(format!("ids: the logits of {n} positions {m}")))?;
        let mut out: Vec<f32> = Vec::with_capacity(n * vocab);
        let mut run = EngineRun::new(Arc::clone(&s.model), &s.kv);
        for (pos, &t) in ids.iter().enumerate() {
            py.check_signals()?;
            let (run, out) = (&mut run, &mut out);
            py.detach(|| {
                catch(|| {
                    s.step(|| {
                        let logits = run.forward(t, pos)?;
                        check_finite(logits, pos)?;
                        out.extend_from_slice(logits);
                        Ok(())
                    })
                })
            })?
            .map_err(py_err)?;
        }
        s.record(&run, n);
        catch(|| PyArray1::from_vec(py, out).reshape([n, vocab]))?
    }

    /// Teacher-forced perplexity of `text` through a fresh cache, as `perplexity --json`:
    /// `flags` are its `--max-tokens` and `--chunk`. Returns its JSON object.
    fn perplexity<'py>(
        &self,
        py: Python<'py>,
        text: String,
        flags: Vec<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let s = &self.shared;
        let argv: Vec<String> = ["--text".to_string(), "<text>".to_string()]
            .into_iter()
            .chain(flags)
            .chain(s.flags.iter().cloned())
            .collect();
        let a = PerplexityFlags::try_parse_from(argv).map_err(flag_err)?.a;
        ppl_cli::check_flags(&a).map_err(py_err)?;
        let tokens = py
            .detach(|| catch(|| ppl_cli::tokens_of(&a, &s.files, &text)))?
            .map_err(py_err)?;
        ppl_cli::check_mode(&a, &s.files, &s.kv, tokens.len()).map_err(py_err)?;
        let mut polled = Polled {
            py,
            shared: s,
            run: EngineRun::new(Arc::clone(&s.model), &s.kv),
            pending: None,
        };
        let r = tinygpt_cpu::eval::perplexity(&mut polled, &tokens, a.chunk, false, &mut |_| {});
        if let Some(e) = polled.pending.take() {
            return Err(e);
        }
        let (r, _) = r.map_err(py_err)?;
        s.record(&polled, tokens.len() - 1);
        json::to_py(py, &ppl_cli::result_json(&r))
    }
}

/// The model's run, stepped with the interpreter released for each token and signals
/// checked before it: what `perplexity` drives. A signal's exception (or a panic's) is
/// kept in `pending` and ends the run.
struct Polled<'py, 'a> {
    py: Python<'py>,
    shared: &'a Shared,
    run: EngineRun<Arc<tinygpt_cpu::model::Model>>,
    pending: Option<PyErr>,
}

impl Engine for Polled<'_, '_> {
    fn forward(&mut self, token: u32, pos: usize) -> tinygpt_cpu::Result<&[f32]> {
        let stopped = |e: PyErr, pending: &mut Option<PyErr>| {
            *pending = Some(e);
            Error::Generate("stopped".into())
        };
        if let Err(e) = self.py.check_signals() {
            return Err(stopped(e, &mut self.pending));
        }
        let (run, shared) = (&mut self.run, self.shared);
        let r = self
            .py
            .detach(|| catch(|| shared.step(|| run.forward(token, pos).map(|_| ()))));
        match r {
            Ok(r) => r?,
            Err(e) => return Err(stopped(e, &mut self.pending)),
        }
        Ok(&self.run.session.logits)
    }
    fn kv_bytes(&self) -> usize {
        self.run.kv_bytes()
    }
    fn stored_tokens(&self) -> usize {
        self.run.stored_tokens()
    }
    fn layers_with_kv(&self) -> usize {
        self.run.layers_with_kv()
    }
    fn set_record_probs(&mut self, on: bool) {
        self.run.set_record_probs(on)
    }
    fn probs(&self) -> &[Vec<f32>] {
        self.run.probs()
    }
    fn positions(&self, l: usize) -> Vec<usize> {
        self.run.positions(l)
    }
    fn reset(&mut self) {
        self.run.reset()
    }
}
