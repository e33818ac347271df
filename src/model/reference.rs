//! The scalar reference model built from the same files as the engine's.

use super::WeightsDType;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::weights::ModelTensors;
use crate::weights::{ModelFiles, Tensor};

/// Builds the scalar reference model from the same files: every weight dequantised to f32
/// after the same `--weights-dtype` conversion the engine applies, so both see equal values.
/// Dequantisation here is the reference's own (`tinygpt_reference::ggml`), not the engine's
/// [`crate::wkernels::dequant`], so a bug in either shows up as a difference.
pub fn reference_model(
    files: &ModelFiles,
    wdtype: WeightsDType,
) -> Result<tinygpt_reference::Model> {
    use tinygpt_reference::model::{LayerWeights, Linear, Weights};
    use tinygpt_reference::ndarray::Array2;
    // The reference model is built with the reference's own dequantisers, so a bug in
    // either side's block decoding shows up as a difference.
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; t.numel()];
        tinygpt_reference::ggml::dequantize_row(t.dtype, t.data.bytes(), &mut out)
            .map_err(|e| Error::tensor(&files.path, &t.name, e.to_string()))?;
        Ok(out)
    };
    let t = ModelTensors::collect(files)?;
    let matrix = |t: &Tensor, values: Vec<f32>| -> Result<Array2<f32>> {
        let error = |msg: String| Error::tensor(&files.path, &t.name, msg);
        match t.shape[..] {
            [rows, cols] => {
                Array2::from_shape_vec((rows, cols), values).map_err(|e| error(e.to_string()))
            }
            _ => Err(error(format!("shape {:?} is not a matrix", t.shape))),
        }
    };
    let m = |t: &Tensor| -> Result<Linear> {
        Ok(match wdtype {
            WeightsDType::Native if t.dtype.is_quantized() => Linear::Ggml {
                ty: t.dtype,
                cols: t.shape[1],
                bytes: t.data.bytes().to_vec(),
            },
            WeightsDType::Bf16 => Linear::F32(matrix(t, f32s(&t.converted(DType::BF16))?)?),
            _ => Linear::F32(matrix(t, f32s(t)?)?),
        })
    };
    let embed_f32 = match wdtype {
        WeightsDType::Bf16 => f32s(&t.embed.converted(DType::BF16))?,
        _ => f32s(t.embed)?,
    };
    let offset = files.config.gemma.norm_offset;
    let norm = |t: &Tensor| -> Result<tinygpt_reference::ndarray::Array1<f32>> {
        let mut w = f32s(t)?;
        if offset != 0.0 {
            w.iter_mut().for_each(|x| *x += offset);
        }
        Ok(w.into())
    };
    let layers = t
        .layers
        .iter()
        .map(|l| {
            Ok(LayerWeights {
                attn_norm: norm(l.attn_norm)?,
                wq: m(l.wq)?,
                wk: l.wk.map(m).transpose()?,
                wv: l.wv.map(m).transpose()?,
                wo: m(l.wo)?,
                bq: l.bq.map(f32s).transpose()?.map(Into::into),
                bk: l.bk.map(f32s).transpose()?.map(Into::into),
                bv: l.bv.map(f32s).transpose()?.map(Into::into),
                q_norm: l.q_norm.map(norm).transpose()?,
                k_norm: l.k_norm.map(norm).transpose()?,
                post_attn_norm: l.post_attn_norm.map(norm).transpose()?,
                post_ffn_norm: l.post_ffn_norm.map(norm).transpose()?,
                ffn_norm: norm(l.ffn_norm)?,
                w_gate: m(l.w_gate)?,
                w_up: m(l.w_up)?,
                w_down: m(l.w_down)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = Weights {
        tied_head: match t.lm_head {
            None if t.embed.dtype.is_quantized() && wdtype == WeightsDType::Native => {
                Some(m(t.embed)?)
            }
            _ => None,
        },
        embed: matrix(t.embed, embed_f32)?,
        layers,
        norm: norm(t.norm)?,
        lm_head: t.lm_head.map(m).transpose()?,
    };
    Ok(tinygpt_reference::Model::new(files.config.clone(), weights))
}
