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
    // A tokenizer.json that does not make a tokenizer is refused, not copied.
    f.tokenizer()?;
    if f.format != Format::HfDir {
        return Err(
            Error::format(&a.hf_dir, "convert takes a Hugging Face model directory").into(),
        );
    }
    check_not_an_input(&a.hf_dir, &a.out)?;
    write_tinygpt(&f, &a.out)?;
    crate::errln!(
        "wrote {} ({} tensors, {} parameters)",
        a.out.display(),
        f.tensors.len(),
        f.parameter_count()
    )?;
    Ok(())
}

/// Refuses an output path that is a directory or one of the files the model is read from
/// (same device and inode, so links and `dir/../dir/x` spellings are caught too):
/// overwriting its own input would destroy the model being converted.
fn check_not_an_input(dir: &std::path::Path, out: &std::path::Path) -> crate::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(out_meta) = std::fs::metadata(out) else {
        return Ok(()); // a new file cannot be an input
    };
    if out_meta.is_dir() {
        return Err(Error::format(
            out,
            "is a directory; give the .tinygpt file to write",
        ));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries.flatten() {
        if let Ok(m) = std::fs::metadata(entry.path()) {
            if m.dev() == out_meta.dev() && m.ino() == out_meta.ino() {
                return Err(Error::format(
                    out,
                    format!(
                        "is {}, one of the files being converted; write the .tinygpt elsewhere",
                        entry.path().display()
                    ),
                ));
            }
        }
    }
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
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::format(out, format!("cannot write: {e}")))?;
    // Written beside the target and renamed over it: a failed write (full disk) never
    // leaves a truncated model under the final name.
    let mut tmp_name = out.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = out.with_file_name(tmp_name);
    let written =
        std::fs::write(&tmp, align_data_section(&bytes)).and_then(|()| std::fs::rename(&tmp, out));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(out, e));
    }
    Ok(())
}

/// Data-section alignment of the files `convert` writes: a cache line, so mmapped rows
/// whose byte length is a multiple of 64 start on one and SIMD loads never straddle two.
const DATA_ALIGN: usize = 64;

/// Pads a serialised safetensors header with trailing spaces (JSON whitespace, which
/// every safetensors reader accepts) so the data section starts `DATA_ALIGN`-aligned.
/// Tensor offsets are relative to the data section, so they stay valid. `st` must be what
/// `safetensors::serialize` returned (an 8-byte header length, the header, the data).
pub fn align_data_section(st: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(st[..8].try_into().expect("8-byte length prefix")) as usize;
    let pad = (DATA_ALIGN - (8 + n) % DATA_ALIGN) % DATA_ALIGN;
    let mut out = Vec::with_capacity(st.len() + pad);
    out.extend_from_slice(&((n + pad) as u64).to_le_bytes());
    out.extend_from_slice(&st[8..8 + n]);
    out.resize(out.len() + pad, b' ');
    out.extend_from_slice(&st[8 + n..]);
    out
}
