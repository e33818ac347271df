//! The model's tensors by role: every tensor the forward pass needs, looked up by its
//! Hugging Face name in a [`ModelFiles`] and shape-checked against the config. Shared by the
//! engine's loader ([`crate::model::Model::load`]) and the reference's
//! ([`crate::model::reference_model`]), and by [`ModelFiles::open`] to validate a file.

use super::{ModelFiles, Tensor};
use crate::error::{Error, Result};

/// The tensors of one decoder layer, looked up by Hugging Face name with shapes checked.
pub struct LayerTensors<'a> {
    pub attn_norm: &'a Tensor,
    pub wq: &'a Tensor,
    /// `None` in a YOCO shared layer (which computes no K/V; the file may omit them).
    pub wk: Option<&'a Tensor>,
    pub wv: Option<&'a Tensor>,
    pub wo: &'a Tensor,
    pub bq: Option<&'a Tensor>,
    pub bk: Option<&'a Tensor>,
    pub bv: Option<&'a Tensor>,
    /// Per-head q/k RMSNorm weights, `(head_dim)` (when `qk_norm`; `k_norm` only in a layer
    /// that holds K/V).
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub ffn_norm: &'a Tensor,
    /// Gemma's norms of the attention and MLP outputs (`sandwich_norms`).
    pub post_attn_norm: Option<&'a Tensor>,
    pub post_ffn_norm: Option<&'a Tensor>,
    pub w_gate: &'a Tensor,
    pub w_up: &'a Tensor,
    pub w_down: &'a Tensor,
}

/// All tensors the forward pass needs, shape-checked against the config.
pub struct ModelTensors<'a> {
    pub embed: &'a Tensor,
    pub layers: Vec<LayerTensors<'a>>,
    pub norm: &'a Tensor,
    /// `None` when tied to the embedding.
    pub lm_head: Option<&'a Tensor>,
}

impl<'a> ModelTensors<'a> {
    /// Looks up and checks every tensor (shared by the engine and the reference loader).
    pub fn collect(files: &'a ModelFiles) -> Result<Self> {
        let c = &files.config;
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = format!("model.layers.{l}");
            let bias = |n: &str, d: usize| files.get_opt(&format!("{p}.self_attn.{n}.bias"), &[d]);
            // A shared layer's k_proj/v_proj (and biases) are ignored, present or not.
            let owns_kv = l < c.layers_with_kv();
            let kv_part = |name: &str, shape: &[usize]| -> Result<Option<&'a Tensor>> {
                match owns_kv {
                    true => files.get(&format!("{p}.self_attn.{name}"), shape).map(Some),
                    false => Ok(None),
                }
            };
            let kv_bias = |name: &str| match owns_kv {
                true => bias(name, kv),
                false => Ok(None),
            };
            let hd = c.head_dim;
            // Gemma names its norms differently: `post_attention_layernorm` is the norm of
            // the attention output, the MLP's input norm is `pre_feedforward_layernorm`.
            let ffn_norm = match c.gemma.sandwich_norms {
                true => "pre_feedforward_layernorm",
                false => "post_attention_layernorm",
            };
            let sandwich = |name: &str| -> Result<Option<&'a Tensor>> {
                match c.gemma.sandwich_norms {
                    true => files.get(&format!("{p}.{name}.weight"), &[h]).map(Some),
                    false => Ok(None),
                }
            };
            let norm = |name: &str, wanted: bool| -> Result<Option<&'a Tensor>> {
                match wanted {
                    true => files
                        .get(&format!("{p}.self_attn.{name}.weight"), &[hd])
                        .map(Some),
                    false => Ok(None),
                }
            };
            layers.push(LayerTensors {
                attn_norm: files.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                wq: files.get(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
                wk: kv_part("k_proj.weight", &[kv, h])?,
                wv: kv_part("v_proj.weight", &[kv, h])?,
                wo: files.get(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                bq: bias("q_proj", q)?,
                bk: kv_bias("k_proj")?,
                bv: kv_bias("v_proj")?,
                q_norm: norm("q_norm", c.qk_norm)?,
                k_norm: norm("k_norm", c.qk_norm && owns_kv)?,
                ffn_norm: files.get(&format!("{p}.{ffn_norm}.weight"), &[h])?,
                post_attn_norm: sandwich("post_attention_layernorm")?,
                post_ffn_norm: sandwich("post_feedforward_layernorm")?,
                w_gate: files.get(&format!("{p}.mlp.gate_proj.weight"), &[ff, h])?,
                w_up: files.get(&format!("{p}.mlp.up_proj.weight"), &[ff, h])?,
                w_down: files.get(&format!("{p}.mlp.down_proj.weight"), &[h, ff])?,
            });
        }
        if c.attention_bias && layers.first().is_some_and(|l| l.bq.is_none()) {
            return Err(Error::tensor(
                &files.path,
                "model.layers.0.self_attn.q_proj.bias",
                "missing (the config says attention_bias = true)",
            ));
        }
        let embed = files.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let norm = files.get("model.norm.weight", &[h])?;
        let lm_head = if files.tensors.contains_key("lm_head.weight") {
            Some(files.get("lm_head.weight", &[c.vocab_size, h])?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(Error::tensor(
                &files.path,
                "lm_head.weight",
                "missing (and tie_word_embeddings is false)",
            ));
        };
        for t in files.tensors.values() {
            if t.dtype.is_quantized()
                && t.shape
                    .last()
                    .is_some_and(|&c| !c.is_multiple_of(t.dtype.block_len()))
            {
                return Err(Error::tensor(
                    &files.path,
                    &t.name,
                    format!(
                        "row length {:?} is not a multiple of the {} block",
                        t.shape, t.dtype
                    ),
                ));
            }
            let want = t.dtype.bytes_for(t.numel());
            if want != Some(t.data.bytes().len()) {
                return Err(Error::tensor(
                    &files.path,
                    &t.name,
                    format!(
                        "holds {} bytes but shape {:?} of {} needs {:?}",
                        t.data.bytes().len(),
                        t.shape,
                        t.dtype,
                        want
                    ),
                ));
            }
        }
        Ok(ModelTensors {
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}
