//! `tinygpt-cpu serve`: the OpenAI-compatible server (see [`crate::server`]).

use super::common::{open_model, CacheArgs, WeightsArg};
use crate::error::Error;
use crate::model::{Model, WeightsDType};
use crate::server::{serve, ServerConfig, PREFILL_TOKENS_PER_STEP};
use clap::Args;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Cache settings every request gets unless it overrides them.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Most sequences generating at once; more are answered 429.
    #[arg(long = "max-sequences", value_name = "N", default_value_t = 64)]
    pub max_sequences: usize,
    /// Most worst-case KV cache bytes admitted at once (sum over sequences); a request
    /// whose cache does not fit is answered 429 with Retry-After.
    #[arg(long = "kv-budget", value_name = "BYTES", default_value_t = 1 << 30)]
    pub kv_budget: usize,
    /// Weight dtype in memory: as stored (native), or converted at load.
    #[arg(long = "weights-dtype", value_enum)]
    pub weights_dtype: Option<WeightsArg>,
    /// Compute threads (default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let kv = a.cache.kv_config()?;
    if a.max_sequences == 0 {
        return Err(Error::flag("--max-sequences", "must be at least 1").into());
    }
    if a.kv_budget == 0 {
        return Err(Error::flag("--kv-budget", "must be at least 1 byte").into());
    }
    if let Some(n) = a.threads {
        if n == 0 || n > 1024 {
            return Err(
                Error::flag("--threads", format!("must be between 1 and 1024, got {n}")).into(),
            );
        }
    }
    let files = open_model(&a.model)?;
    crate::kv_cache::validate(&kv, &files.config)?;
    let wdtype = match a.weights_dtype {
        Some(WeightsArg::Native) | None => WeightsDType::Native,
        Some(WeightsArg::F32) => WeightsDType::F32,
        Some(WeightsArg::Bf16) => WeightsDType::Bf16,
    };
    let model = Model::load(&files, wdtype)?;
    let model_name = match &a.model {
        Some(p) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string()),
        None => "tinygpt-cpu-default".to_string(),
    };
    let cfg = ServerConfig {
        kv,
        allow_past_context: a.cache.allow_past_context,
        max_sequences: a.max_sequences,
        kv_budget: a.kv_budget,
        model_name: model_name.clone(),
        prefill_tokens_per_step: PREFILL_TOKENS_PER_STEP,
    };
    let addr = SocketAddr::new(a.host, a.port);
    serve(
        model,
        files.tokenizer.clone(),
        files.chat_template.clone(),
        cfg,
        addr,
        a.threads,
        |bound| {
            // Scripts and tests read this line to find the port.
            println!("listening on http://{bound} (model {model_name})");
            let _ = std::io::stdout().flush();
        },
    )?;
    eprintln!("drained, exiting");
    Ok(())
}
