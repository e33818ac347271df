//! Flags shared by several subcommands: the KV cache settings, the engine choice and how it
//! executes ([`ExecArgs`] → [`crate::exec::ExecOptions`]; the one place the `TINYGPT_*`
//! execution variables are read, as clap defaults of those flags).

use crate::config::Config;
use crate::error::{Error, Result};
use crate::exec::{parse_switch, ExecOptions, KernelChoice, KvKernelChoice};
use crate::generate::GenerateOptions;
use crate::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use crate::model::WeightsDType;
use crate::sampler::SamplerConfig;
use crate::weights::{Format, ModelFiles};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// The values of `--kv-quantize`, `--kv-quantize-k` and `--kv-quantize-v`: every
/// precision's name, from [`Precision::ALL`] (so a new precision needs no CLI change).
pub fn precision_parser() -> impl clap::builder::TypedValueParser<Value = Precision> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Precision::ALL.map(Precision::name))
        .try_map(|s| Precision::parse(&s).ok_or("not a KV precision"))
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum KeyRopeArg {
    Pre,
    Post,
}

impl From<KeyRopeArg> for KeyRope {
    fn from(k: KeyRopeArg) -> KeyRope {
        match k {
            KeyRopeArg::Pre => KeyRope::Pre,
            KeyRopeArg::Post => KeyRope::Post,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum RotationArg {
    Auto,
    None,
    Hadamard,
}

impl From<RotationArg> for KvRotation {
    fn from(r: RotationArg) -> KvRotation {
        match r {
            RotationArg::Auto => KvRotation::Auto,
            RotationArg::None => KvRotation::None,
            RotationArg::Hadamard => KvRotation::Hadamard,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Positions {
    Original,
    Cache,
}

impl From<Positions> for PositionsMode {
    fn from(p: Positions) -> PositionsMode {
        match p {
            Positions::Original => PositionsMode::Original,
            Positions::Cache => PositionsMode::Cache,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum EngineKind {
    Optimized,
    /// The scalar reference crate (builds with the `reference-engine` feature only).
    Reference,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum WeightsArg {
    Native,
    F32,
    Bf16,
}

/// KV cache flags (docs/design.md §4).
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// StreamingLLM: attention-sink tokens kept forever.
    #[arg(long = "streaming-llm-sink", value_name = "N")]
    pub sink: Option<usize>,
    /// StreamingLLM: most recent tokens kept; enables eviction.
    #[arg(long = "streaming-llm-window", value_name = "M")]
    pub window: Option<usize>,
    /// Where RoPE positions come from under StreamingLLM.
    #[arg(
        long = "streaming-llm-positions",
        value_enum,
        default_value = "original"
    )]
    pub positions: Positions,
    /// KV cache storage precision (int8/int4/int2: KIVI, K per channel in groups, V per
    /// token).
    #[arg(long = "kv-quantize", value_parser = precision_parser(), default_value = "fp32")]
    pub kv_quantize: Precision,
    /// K's storage precision, overriding --kv-quantize for K (e.g. int8 with
    /// --kv-quantize-v int4 for K8V4).
    #[arg(long = "kv-quantize-k", value_parser = precision_parser(), value_name = "P")]
    pub kv_quantize_k: Option<Precision>,
    /// V's storage precision, overriding --kv-quantize for V.
    #[arg(long = "kv-quantize-v", value_parser = precision_parser(), value_name = "P")]
    pub kv_quantize_v: Option<Precision>,
    /// Tokens per K quantisation group (int8/int4/int2).
    #[arg(long = "kv-group-size", value_name = "G", default_value_t = 32)]
    pub group_size: usize,
    /// KIVI residual: the newest R tokens of a quantised K/V side stay f32 (0: quantise
    /// V at append and each K group as soon as it is complete).
    #[arg(
        long = "kv-residual",
        value_name = "R",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub residual: usize,
    /// Store keys before RoPE (pre) and rotate them at read time, or after (post). In
    /// `cache` positions mode keys are always stored before RoPE, so this has no effect.
    #[arg(long = "kv-key-rope", value_enum, default_value = "post")]
    pub key_rope: KeyRopeArg,
    /// Rotate each head's keys and values by the normalised Walsh-Hadamard matrix before
    /// storing them (queries and outputs rotated to match; attention is unchanged up to
    /// rounding): spreads outlier channels before KIVI quantises them. auto: rotate when K
    /// or V is int8/int4/int2, keys are stored after RoPE and head_dim is a power of two;
    /// none: KIVI as published; hadamard: always (needs a power-of-two head_dim).
    #[arg(long = "kv-rotation", value_enum, default_value = "auto")]
    pub rotation: RotationArg,
    /// Allow generating past the model's context length with an unbounded cache.
    #[arg(long = "allow-past-context")]
    pub allow_past_context: bool,
}

impl CacheArgs {
    /// The generation settings of a run through `kv` (what [`kv_config`](Self::kv_config)
    /// gave) on a model configured as `cfg`: the one place the CLI builds them. Validates
    /// the sampler.
    pub fn generate_options(
        &self,
        kv: &KvConfig,
        cfg: &Config,
        max_tokens: usize,
        sampler: SamplerConfig,
        ignore_eos: bool,
    ) -> Result<GenerateOptions> {
        GenerateOptions::new(
            max_tokens,
            sampler,
            ignore_eos,
            kv,
            cfg.max_position_embeddings,
            self.allow_past_context,
        )
    }

    /// The cache configuration these flags describe, validated.
    pub fn kv_config(&self) -> Result<KvConfig> {
        if self.sink.is_some() && self.window.is_none() {
            return Err(Error::flag(
                "--streaming-llm-sink",
                "needs --streaming-llm-window M (the number of recent tokens to keep)",
            ));
        }
        if self.window == Some(0) && self.sink.unwrap_or(0) == 0 {
            return Err(Error::flag(
                "--streaming-llm-window",
                "must be > 0 when --streaming-llm-sink is 0 (the cache would hold nothing)",
            ));
        }
        if self.group_size == 0 {
            return Err(Error::flag("--kv-group-size", "must be > 0"));
        }
        const MAX: usize = 1 << 28;
        if self.group_size > 1 << 20 {
            return Err(Error::flag(
                "--kv-group-size",
                format!("{} is absurdly large", self.group_size),
            ));
        }
        for (flag, v) in [
            ("--streaming-llm-sink", self.sink),
            ("--streaming-llm-window", self.window),
            ("--kv-residual", Some(self.residual)),
        ] {
            if let Some(v) = v {
                if v > MAX {
                    return Err(Error::flag(
                        flag,
                        format!("{v} is absurdly large (max {MAX})"),
                    ));
                }
            }
        }
        Ok(KvConfig {
            precision: self.kv_quantize,
            group_size: self.group_size,
            sink: self.sink.unwrap_or(0),
            window: self.window,
            positions: self.positions.into(),
            k_precision: self.kv_quantize_k,
            v_precision: self.kv_quantize_v,
            residual: self.residual,
            key_rope: self.key_rope.into(),
            rotation: self.rotation.into(),
        })
    }
}

/// How the engine executes: the flags behind [`ExecOptions`] but `--threads` and
/// `--adaptive` (which `EngineArgs` adds). Each flag's default can come from its
/// `TINYGPT_*` variable (listed in `--help`); a bad value, from the flag or the variable,
/// is an error naming the flag.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    /// Weight kernel variant: `auto` (the fastest this CPU has) or one of scalar,
    /// portable, avx2, avx512vnni, neon-dotprod (same results bit for bit).
    #[arg(long, value_name = "VARIANT", env = "TINYGPT_KERNEL", default_value = "auto",
          value_parser = |s: &str| s.parse::<KernelChoice>().map_err(flag_msg))]
    pub kernel: KernelChoice,
    /// KIVI attention kernels: `fast` (the fastest this CPU has), `exact` (the
    /// reference's bits), or one of portable, avx2, avx512, avx512-exact, neon.
    #[arg(long = "kv-kernel", value_name = "KIND", env = "TINYGPT_KV_KERNEL",
          default_value = "fast",
          value_parser = |s: &str| s.parse::<KvKernelChoice>().map_err(flag_msg))]
    pub kv_kernel: KvKernelChoice,
    /// Run one sequence's decode step as a team of the threads (`off`: one fork/join per
    /// product; same results).
    #[arg(long, value_name = "on|off", env = "TINYGPT_TEAM", default_value = "on",
          action = clap::ArgAction::Set,
          value_parser = |s: &str| parse_switch("--team", s).map_err(flag_msg))]
    pub team: bool,
    /// Split attention within KV heads in a decode team: auto (when it pays), always,
    /// never (same results).
    #[arg(long = "attn-split", value_name = "WHEN", env = "TINYGPT_ATTN_SPLIT",
          default_value = "auto",
          value_parser = |s: &str| s.parse::<crate::attention::AttnSplit>().map_err(flag_msg))]
    pub attn_split: crate::attention::AttnSplit,
}

/// The message of a flag error, for clap (which names the flag itself).
fn flag_msg(e: Error) -> String {
    match e {
        Error::Flag { msg, .. } => msg,
        other => other.to_string(),
    }
}

impl ExecArgs {
    /// The options these flags give, with `threads` and the adaptive choice.
    pub fn options(&self, threads: Option<usize>, adaptive: bool) -> ExecOptions {
        ExecOptions {
            kernel: self.kernel,
            kv_kernel: self.kv_kernel,
            threads,
            team: self.team,
            attn_split: self.attn_split,
            adaptive,
        }
    }
}

/// Engine and weight flags.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Which implementation runs the forward pass.
    #[arg(long, value_enum, default_value = "optimized")]
    pub engine: EngineKind,
    /// Weight dtype in memory: as stored (native), or converted at load.
    #[arg(long = "weights-dtype", value_enum)]
    pub weights_dtype: Option<WeightsArg>,
    /// Worker threads (default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Without `--threads`, choose between the team and one thread by measured step
    /// times, and run batches on one thread when the machine is crowded (same results).
    #[arg(long, value_name = "on|off", env = "TINYGPT_ADAPTIVE", default_value = "on",
          action = clap::ArgAction::Set,
          value_parser = |s: &str| parse_switch("--adaptive", s).map_err(flag_msg))]
    pub adaptive: bool,
    #[command(flatten)]
    pub exec: ExecArgs,
}

impl EngineArgs {
    /// The weight dtype; the default is `native` for every format (GGUF blocks stay
    /// blocks, f16/bf16 stay half width).
    pub fn weights_dtype(&self, _format: Format) -> WeightsDType {
        match self.weights_dtype {
            Some(WeightsArg::Native) | None => WeightsDType::Native,
            Some(WeightsArg::F32) => WeightsDType::F32,
            Some(WeightsArg::Bf16) => WeightsDType::Bf16,
        }
    }

    /// Runs `f` on a worker of a rayon pool of `--threads` threads (default: all cores).
    /// The decode loop then runs *inside* the pool, so each kernel's parallel region is
    /// a hot fork-join among awake workers instead of a job injected from the main
    /// thread and waited for on a sleeping latch (which cost more than a tiny model's
    /// whole matvec).
    pub fn in_pool<T: Send>(
        &self,
        f: impl FnOnce() -> anyhow::Result<T> + Send,
    ) -> anyhow::Result<T> {
        self.engine.available()?;
        self.thread_pool()?.install(f)
    }

    /// The execution options these flags give: `--adaptive` applies only without
    /// `--threads` (a thread count asked for is kept).
    pub fn exec_options(&self) -> ExecOptions {
        self.exec
            .options(self.threads, self.adaptive && self.threads.is_none())
    }

    /// The rayon pool of `--threads` threads (default: all cores), checked.
    pub fn thread_pool(&self) -> Result<rayon::ThreadPool> {
        let mut b = rayon::ThreadPoolBuilder::new();
        if let Some(n) = self.threads {
            if n == 0 || n > 1024 {
                return Err(Error::flag(
                    "--threads",
                    format!("must be between 1 and 1024, got {n}"),
                ));
            }
            b = b.num_threads(n);
        }
        b.build()
            .map_err(|e| Error::flag("--threads", e.to_string()))
    }
}

/// Opens MODEL (or the bundled model).
pub fn open_model(model: &Option<PathBuf>) -> Result<ModelFiles> {
    ModelFiles::open(model.as_deref())
}

/// Human-readable byte count.
pub fn human_bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

impl EngineKind {
    /// `Ok` when this build has the engine: the scalar reference runs only in a build with
    /// the `reference-engine` feature (the tests' build has it; the shipped binary does
    /// not link the reference crate).
    pub fn available(self) -> Result<()> {
        match self {
            EngineKind::Optimized => Ok(()),
            EngineKind::Reference if cfg!(feature = "reference-engine") => Ok(()),
            EngineKind::Reference => Err(Error::flag(
                "--engine",
                "`reference` is not in this build; build with \
                 `cargo build --release --features reference-engine` to run it",
            )),
        }
    }
}

/// A model loaded for either engine.
pub enum Loaded {
    Optimized(crate::model::Model),
    #[cfg(feature = "reference-engine")]
    Reference(tinygpt_reference::Model),
}

impl Loaded {
    pub fn load(files: &ModelFiles, engine: &EngineArgs) -> Result<Loaded> {
        engine.engine.available()?;
        let w = engine.weights_dtype(files.format);
        crate::memory::check_weights_fit(files, w, engine.engine == EngineKind::Reference)?;
        Ok(match engine.engine {
            EngineKind::Optimized => Loaded::Optimized(crate::model::Model::load_opts(
                files,
                w,
                &engine.exec_options(),
            )?),
            #[cfg(feature = "reference-engine")]
            EngineKind::Reference => Loaded::Reference(crate::model::reference_model(files, w)?),
            #[cfg(not(feature = "reference-engine"))]
            EngineKind::Reference => unreachable!("checked by `available` above"),
        })
    }

    /// The optimised engine's model; `what` (the caller, e.g. "the Python package") runs
    /// only that one, so the reference engine is an error naming `--engine`.
    #[cfg_attr(not(feature = "reference-engine"), allow(unused_variables))]
    pub fn into_optimized(self, what: &str) -> Result<crate::model::Model> {
        match self {
            Loaded::Optimized(m) => Ok(m),
            #[cfg(feature = "reference-engine")]
            Loaded::Reference(_) => Err(Error::flag(
                "--engine",
                format!("{what} runs the optimized engine"),
            )),
        }
    }

    /// A fresh run (empty cache) with `kv`.
    pub fn run(&self, kv: &KvConfig) -> Box<dyn crate::generate::Engine + '_> {
        match self {
            Loaded::Optimized(m) => Box::new(crate::generate::EngineRun::new(m, kv)),
            #[cfg(feature = "reference-engine")]
            Loaded::Reference(m) => Box::new(crate::generate::ReferenceRun::new(m, kv)),
        }
    }
}

/// A progress bar on stderr, hidden when `quiet` or stderr is not a terminal.
pub fn progress(len: u64, quiet: bool, label: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {pos}/{len} tok  {per_sec}  ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb.set_message(label.to_string());
    pb
}
