//! `tinygpt-cpu inspect`: what a model file holds.

use super::common::human_bytes;
use crate::dtype::DType;
use crate::outln;
use crate::weights::ModelFiles;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory.
    pub model: Option<PathBuf>,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let f = ModelFiles::open(a.model.as_deref())?;
    let tokenizer = f.tokenizer()?;
    let c = &f.config;
    outln!("model:       {}", f.path.display())?;
    outln!("format:      {}", f.format.name())?;
    outln!(
        "file size:   {} ({} bytes)",
        human_bytes(f.file_bytes),
        f.file_bytes
    )?;
    outln!(
        "parameters:  {} ({:.2}M)",
        f.parameter_count(),
        f.parameter_count() as f64 / 1e6
    )?;
    let dt: Vec<String> = f
        .dtype_summary()
        .iter()
        .map(|(k, v)| format!("{k} x{v}"))
        .collect();
    outln!("dtypes:      {}", dt.join(", "))?;
    // Every type is held and multiplied as it is stored; say whose code runs for each.
    let k = crate::wkernels::default_kernel();
    let borrowed: Vec<String> = f
        .dtype_summary()
        .keys()
        .filter_map(|n| DType::from_name(n))
        .filter_map(|t| {
            let code = crate::wkernels::Kernels::new(k, t).code();
            (code != k).then(|| format!("{t}: {}", code.name()))
        })
        .collect();
    if borrowed.is_empty() {
        outln!("kernels:     {}", k.name())?;
    } else {
        outln!("kernels:     {} ({})", k.name(), borrowed.join(", "))?;
    }
    outln!(
        "vocab:       {} (tokenizer: {})",
        c.vocab_size,
        tokenizer.vocab_size()
    )?;
    outln!("hidden:      {}", c.hidden_size)?;
    outln!("layers:      {}", c.n_layers)?;
    outln!(
        "heads:       {} (kv heads {}, head_dim {})",
        c.n_heads,
        c.n_kv_heads,
        c.head_dim
    )?;
    outln!("ffn:         {}", c.intermediate_size)?;
    outln!("context:     {}", c.max_position_embeddings)?;
    outln!("rope theta:  {} ({:?})", c.rope_theta, c.rope_scaling)?;
    outln!("rms eps:     {}", c.rms_norm_eps)?;
    outln!("tied embed:  {}", c.tie_word_embeddings)?;
    let extras: Vec<&str> = [
        (c.attention_bias, "q/k/v biases"),
        (c.qk_norm, "per-head q/k RMSNorm"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, what)| *what)
    .collect();
    if !extras.is_empty() {
        outln!("attention:   {}", extras.join(", "))?;
    }
    if let Some(w) = c.sliding_window {
        outln!("sliding win: {w}")?;
    }
    if !c.layer_types.is_empty() {
        let types: Vec<String> = c
            .layer_types
            .iter()
            .map(|t| match t {
                crate::config::AttentionType::Full => "full".to_string(),
                crate::config::AttentionType::Sliding { window } => format!("sliding({window})"),
            })
            .collect();
        outln!("layer types: {}", types.join(", "))?;
    }
    if c.num_kv_shared_layers > 0 {
        let shared: Vec<String> = (c.layers_with_kv()..c.n_layers)
            .map(|l| format!("{l}<-{}", c.kv_source(l).unwrap_or(l)))
            .collect();
        outln!(
            "kv sharing:  {} of {} layers hold K/V; shared (layer<-source): {}",
            c.layers_with_kv(),
            c.n_layers,
            shared.join(", ")
        )?;
    }
    outln!(
        "bos/eos:     {:?} / {:?}",
        c.bos_token_id,
        tokenizer.eos_ids
    )?;
    outln!(
        "chat tmpl:   {}",
        if f.chat_template.is_some() {
            "yes"
        } else {
            "no"
        }
    )?;
    Ok(())
}
