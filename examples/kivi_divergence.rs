//! How far apart two correct KIVI implementations land (docs/design.md §2.4).
//!
//! Teacher-forces the same token ids through the engine and the scalar reference with the
//! same cache configuration and reports the per-token NLL difference engine − reference:
//! its mean, its standard deviation and the standard error of the mean. With an exact cache
//! (fp32) the difference is float rounding; under KIVI each side's float-order differences
//! flip a few codes (or an f16 scale), the flips cascade, and the two runs become two
//! draws of the quantisation noise. A mean within a few standard errors of zero says the
//! two sides implement the same numerics; a bias would not average out.
//!
//! ```sh
//! cargo run --release --example kivi_divergence -- MODEL TEXT N int4 [f32|native|bf16]
//! ```
//! `TEXT` is tokenised as `perplexity --text` does; the first `N` tokens are used.

use std::path::Path;
use tinygpt_cpu::eval::nll_of;
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::{KvConfig, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 4 {
        anyhow::bail!("usage: kivi_divergence MODEL TEXT N PRECISION [f32|native|bf16]");
    }
    let n: usize = a[2].parse()?;
    let precision =
        Precision::parse(&a[3]).ok_or_else(|| anyhow::anyhow!("unknown precision {:?}", a[3]))?;
    let wdtype = match a.get(4).map(String::as_str) {
        None | Some("f32") => WeightsDType::F32,
        Some("native") => WeightsDType::Native,
        Some("bf16") => WeightsDType::Bf16,
        Some(o) => anyhow::bail!("unknown weights dtype {o:?}"),
    };
    let files = ModelFiles::open(Some(Path::new(&a[0])))?;
    let ids = files
        .tokenizer()?
        .encode(&tinygpt_cpu::eval::read_text(Path::new(&a[1]))?)?;
    anyhow::ensure!(n >= 2 && n <= ids.len(), "N must be in 2..={}", ids.len());
    let model = Model::load(&files, wdtype)?;
    let reference = reference_model(&files, wdtype)?;
    let kv = KvConfig {
        precision,
        ..KvConfig::default()
    };
    let mut e = EngineRun::new(&model, &kv);
    let mut r = ReferenceRun::new(&reference, &kv);
    let mut d = Vec::with_capacity(n - 1);
    let (mut se, mut sr) = (0.0f64, 0.0f64);
    for t in 0..n - 1 {
        let ne = nll_of(e.forward(ids[t], t)?, ids[t + 1]);
        let nr = nll_of(r.forward(ids[t], t)?, ids[t + 1]);
        se += ne;
        sr += nr;
        d.push(ne - nr);
    }
    let m = d.len() as f64;
    let mean = d.iter().sum::<f64>() / m;
    let sd = (d.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (m - 1.0)).sqrt();
    println!(
        "{} tokens, kv {}: ppl engine {:.5} reference {:.5}; per-token NLL difference mean {:+.5} sd {:.5} se {:.5} ({:+.1} se)",
        n,
        precision.name(),
        (se / m).exp(),
        (sr / m).exp(),
        mean,
        sd,
        sd / m.sqrt(),
        mean / (sd / m.sqrt()).max(f64::MIN_POSITIVE)
    );
    Ok(())
}
