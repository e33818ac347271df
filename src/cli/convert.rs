//! `tinygpt-cpu convert HF_DIR OUT.tinygpt`: one self-contained file per model.

use crate::error::Error;
use crate::weights::{Format, ModelFiles, META_CHAT_TEMPLATE, META_CONFIG, META_TOKENIZER};
use clap::Args;
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// A Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    pub hf_dir: PathBuf,
    /// The .tinygpt file to write.
    pub out: PathBuf,
}

pub fn run(a: ConvertArgs) -> anyhow::Result<()> {
    let f = ModelFiles::open(Some(&a.hf_dir))?;
    if f.format != Format::HfDir {
        return Err(
            Error::format(&a.hf_dir, "convert takes a Hugging Face model directory").into(),
        );
    }
    write_tinygpt(&f, &a.out)?;
    eprintln!(
        "wrote {} ({} tensors, {} parameters)",
        a.out.display(),
        f.tensors.len(),
        f.parameter_count()
    );
    Ok(())
}

/// Writes `f` as a `.tinygpt` file: safetensors with the config and tokenizer in `__metadata__`.
pub fn write_tinygpt(f: &ModelFiles, out: &std::path::Path) -> crate::Result<()> {
    let mut meta = HashMap::new();
    let cfg = f
        .config_json
        .clone()
        .ok_or_else(|| Error::format(&f.path, "no config.json text"))?;
    let tok = f
        .tokenizer_json
        .clone()
        .ok_or_else(|| Error::format(&f.path, "no tokenizer.json text"))?;
    meta.insert(META_CONFIG.to_string(), cfg);
    meta.insert(META_TOKENIZER.to_string(), tok);
    if let Some(t) = &f.chat_template {
        meta.insert(META_CHAT_TEMPLATE.to_string(), t.clone());
    }
    let mut views = Vec::new();
    for t in f.tensors.values() {
        let dtype = match t.dtype {
            crate::dtype::DType::F32 => safetensors::Dtype::F32,
            crate::dtype::DType::F16 => safetensors::Dtype::F16,
            crate::dtype::DType::BF16 => safetensors::Dtype::BF16,
            other => {
                return Err(Error::tensor(
                    &f.path,
                    &t.name,
                    format!("{other} cannot be written to .tinygpt"),
                ))
            }
        };
        let view = safetensors::tensor::TensorView::new(dtype, t.shape.clone(), t.data.bytes())
            .map_err(|e| Error::tensor(&f.path, &t.name, e.to_string()))?;
        views.push((t.name.clone(), view));
    }
    safetensors::serialize_to_file(views, Some(meta), out)
        .map_err(|e| Error::format(out, format!("cannot write: {e}")))?;
    Ok(())
}
