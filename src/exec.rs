//! How the engine executes, as one value the caller builds and hands to the model:
//! [`ExecOptions`] (weight kernel variant, exact or fast KIVI kernels, threads, the decode
//! team, the attention split, the adaptive thread choice).
//!
//! Nothing in the library reads the environment for these: the CLI builds an
//! `ExecOptions` from its flags (`--kernel`, `--kv-kernel`, `--team`, `--attn-split`,
//! `--adaptive`, `--threads`; each flag's default may come from a `TINYGPT_*` variable,
//! read by clap, listed in `--help`) and passes it to [`crate::model::Model::load_opts`].
//! Every choice here is a choice of speed or of summation order only where documented:
//! the weight kernel variants and the team, split and adaptive choices give the same bits;
//! the KIVI kernel is either exact (the reference's bits, docs/design.md §2.4) or fast.
//!
//! [`Default`] is the engine's behaviour when the caller names nothing: the fastest weight
//! kernel, the fast KIVI kernels, the pool the caller runs in, the team on, the split when
//! it pays, no adaptive choice.

use crate::attention::AttnSplit;
use crate::error::{Error, Result};
use crate::kivi::KvKernel;
use crate::wkernels::Kernel;
use std::str::FromStr;

/// The weight kernel variant (`--kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    /// The fastest variant this CPU supports ([`Kernel::best`]).
    #[default]
    Auto,
    /// This variant (checked to be supported when parsed).
    Named(Kernel),
}

impl KernelChoice {
    /// The variant this choice runs.
    pub fn resolve(self) -> Kernel {
        match self {
            KernelChoice::Auto => Kernel::best(),
            KernelChoice::Named(k) => k,
        }
    }
}

impl FromStr for KernelChoice {
    type Err = Error;

    /// `auto` or a variant name ([`Kernel::name`]) this CPU supports; anything else is an
    /// error naming `--kernel`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "auto" {
            return Ok(KernelChoice::Auto);
        }
        let names = || {
            let mut v = vec!["auto"];
            v.extend(Kernel::supported().into_iter().map(Kernel::name));
            v.join(", ")
        };
        match Kernel::from_name(s) {
            Some(k) if k.is_supported() => Ok(KernelChoice::Named(k)),
            Some(_) => Err(Error::flag(
                "--kernel",
                format!("this CPU lacks `{s}` (supported: {})", names()),
            )),
            None => Err(Error::flag(
                "--kernel",
                format!("unknown kernel variant `{s}` (supported: {})", names()),
            )),
        }
    }
}

/// The KIVI attention kernels (`--kv-kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvKernelChoice {
    /// The fastest supported variant ([`KvKernel::best`]`(false)`).
    #[default]
    Fast,
    /// The fastest variant that adds in the reference's order ([`KvKernel::best`]`(true)`):
    /// the reference's bits under KIVI.
    Exact,
    /// This variant (checked to be supported when parsed; for A/B runs and tests).
    Named(KvKernel),
}

impl KvKernelChoice {
    /// The variant this choice runs.
    pub fn resolve(self) -> KvKernel {
        match self {
            KvKernelChoice::Fast => KvKernel::best(false),
            KvKernelChoice::Exact => KvKernel::best(true),
            KvKernelChoice::Named(k) => k,
        }
    }
}

impl FromStr for KvKernelChoice {
    type Err = Error;

    /// `fast`, `exact`, or a variant name ([`KvKernel::name`]) this CPU supports; anything
    /// else is an error naming `--kv-kernel`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        match s {
            "fast" => return Ok(KvKernelChoice::Fast),
            "exact" => return Ok(KvKernelChoice::Exact),
            _ => {}
        }
        let names = || {
            let mut v = vec!["fast", "exact"];
            v.extend(KvKernel::supported().into_iter().map(KvKernel::name));
            v.join(", ")
        };
        match KvKernel::from_name(s) {
            Some(k) if k.is_supported() => Ok(KvKernelChoice::Named(k)),
            Some(_) => Err(Error::flag(
                "--kv-kernel",
                format!("this CPU lacks `{s}` (supported: {})", names()),
            )),
            None => Err(Error::flag(
                "--kv-kernel",
                format!("unknown KIVI kernel `{s}` (supported: {})", names()),
            )),
        }
    }
}

impl FromStr for AttnSplit {
    type Err = Error;

    /// `auto`, `always` or `never`; anything else is an error naming `--attn-split`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" => Ok(AttnSplit::Auto),
            "always" => Ok(AttnSplit::Always),
            "never" => Ok(AttnSplit::Never),
            other => Err(Error::flag(
                "--attn-split",
                format!("`{other}` is not one of auto, always, never"),
            )),
        }
    }
}

/// Parses an on/off switch for `flag` (`on`/`off`, also `true`/`false`, `1`/`0`).
pub fn parse_switch(flag: &str, s: &str) -> Result<bool> {
    match s.trim() {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        other => Err(Error::flag(flag, format!("`{other}` is not on or off"))),
    }
}

/// How the engine executes (see the module docs). Built by the caller (the CLI from its
/// flags), held by the model ([`crate::model::Model::options`]); each session starts
/// with the model's team, split and adaptive choices and may change them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecOptions {
    /// The weight kernel variant every matrix is resolved for at load (`--kernel`).
    /// Every variant gives the same bits.
    pub kernel: KernelChoice,
    /// The KIVI attention kernels (`--kv-kernel`): fast (default) or exact (the
    /// reference's bits, docs/design.md §2.4). Resolved once per session.
    pub kv_kernel: KvKernelChoice,
    /// Compute threads (`--threads`; `None`: all cores). The caller sizes the rayon pool it
    /// runs the model in from it; the model itself uses whatever pool it runs in.
    pub threads: Option<usize>,
    /// Whether one sequence's decode step may run as a team ([`crate::relay`]; `--team`).
    /// Off: every product is its own rayon fork/join (A/B runs). Same bits either way.
    pub team: bool,
    /// Whether a decode team splits attention within KV heads (`--attn-split`). Same bits
    /// either way.
    pub attn_split: AttnSplit,
    /// Whether decode steps choose between the team and one thread by measured step
    /// times, and batches run on one thread when the machine is crowded
    /// ([`crate::threads::Pace`], [`crate::threads::batch`]; `--adaptive`, which the CLI
    /// applies only without `--threads`). Same bits either way.
    pub adaptive: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            kernel: KernelChoice::Auto,
            kv_kernel: KvKernelChoice::Fast,
            threads: None,
            team: true,
            attn_split: AttnSplit::Auto,
            adaptive: false,
        }
    }
}

impl ExecOptions {
    /// The default options with the exact KIVI kernels (the reference's bits).
    pub fn exact() -> Self {
        ExecOptions {
            kv_kernel: KvKernelChoice::Exact,
            ..ExecOptions::default()
        }
    }

    /// Checks what parsing cannot: `threads` between 1 and 1024 (an error naming
    /// `--threads`).
    pub fn validate(&self) -> Result<()> {
        if let Some(n) = self.threads {
            if n == 0 || n > 1024 {
                return Err(Error::flag(
                    "--threads",
                    format!("must be between 1 and 1024, got {n}"),
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for ExecOptions {
    /// One line of what runs (the variants resolved): `kernel avx2 | kv-kernel avx512 |
    /// team on | attn-split auto | adaptive off | threads all`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = |b: bool| if b { "on" } else { "off" };
        let split = match self.attn_split {
            AttnSplit::Auto => "auto",
            AttnSplit::Always => "always",
            AttnSplit::Never => "never",
        };
        write!(
            f,
            "kernel {} | kv-kernel {} | team {} | attn-split {split} | adaptive {} | threads ",
            self.kernel.resolve().name(),
            self.kv_kernel.resolve().name(),
            on(self.team),
            on(self.adaptive),
        )?;
        match self.threads {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "all"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag_of(e: Error) -> String {
        match e {
            Error::Flag { flag, .. } => flag,
            other => panic!("not a flag error: {other}"),
        }
    }

    #[test]
    fn parsers_accept_the_documented_values() {
        assert_eq!("auto".parse::<KernelChoice>().unwrap(), KernelChoice::Auto);
        assert_eq!(
            "scalar".parse::<KernelChoice>().unwrap(),
            KernelChoice::Named(Kernel::Scalar)
        );
        assert_eq!(KernelChoice::Auto.resolve(), Kernel::best());
        assert_eq!(
            "fast".parse::<KvKernelChoice>().unwrap(),
            KvKernelChoice::Fast
        );
        assert_eq!(
            "exact".parse::<KvKernelChoice>().unwrap(),
            KvKernelChoice::Exact
        );
        assert_eq!(
            "portable".parse::<KvKernelChoice>().unwrap(),
            KvKernelChoice::Named(KvKernel::Portable)
        );
        assert!(KvKernelChoice::Exact.resolve().is_exact());
        assert_eq!(KvKernelChoice::Fast.resolve(), KvKernel::best(false));
        assert_eq!("never".parse::<AttnSplit>().unwrap(), AttnSplit::Never);
        assert!(!parse_switch("--team", "off").unwrap());
        assert!(parse_switch("--team", "on").unwrap());
    }

    #[test]
    fn bad_values_are_errors_naming_the_flag() {
        assert_eq!(
            flag_of("avx9".parse::<KernelChoice>().unwrap_err()),
            "--kernel"
        );
        assert_eq!(
            flag_of("slow".parse::<KvKernelChoice>().unwrap_err()),
            "--kv-kernel"
        );
        assert_eq!(
            flag_of("sometimes".parse::<AttnSplit>().unwrap_err()),
            "--attn-split"
        );
        assert_eq!(
            flag_of(parse_switch("--team", "maybe").unwrap_err()),
            "--team"
        );
        // A variant this CPU lacks is an error too, not a silent fallback.
        for k in Kernel::ALL.into_iter().filter(|k| !k.is_supported()) {
            assert_eq!(
                flag_of(k.name().parse::<KernelChoice>().unwrap_err()),
                "--kernel"
            );
        }
        for k in KvKernel::ALL.into_iter().filter(|k| !k.is_supported()) {
            let e = k.name().parse::<KvKernelChoice>().unwrap_err();
            assert_eq!(flag_of(e), "--kv-kernel");
        }
        let opts = ExecOptions {
            threads: Some(0),
            ..ExecOptions::default()
        };
        assert_eq!(flag_of(opts.validate().unwrap_err()), "--threads");
    }

    #[test]
    fn default_is_the_engine_without_choices() {
        let d = ExecOptions::default();
        assert_eq!(d.kernel.resolve(), Kernel::best());
        assert_eq!(d.kv_kernel.resolve(), KvKernel::best(false));
        assert!(d.team && !d.adaptive && d.threads.is_none());
        assert_eq!(d.attn_split, AttnSplit::Auto);
        assert!(ExecOptions::exact().kv_kernel.resolve().is_exact());
    }
}
