//! GGUF tensor names and data as Hugging Face's: [`GgufFile::hf_tensors`] renames each tensor
//! (llama.cpp's `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`, Gemma's
//! sandwich norms included) and undoes llama.cpp's Q/K row permutation for the architectures
//! that carry it ([`unpermute_qk_rows`]). [`hf_name_for`] is also what the shape check in
//! `metadata.rs` asks whether a tensor it did not expect is a known one.

use super::{GgufFile, GgufTensor};
use crate::error::{Error, Result};
use std::borrow::Cow;

/// Which llama.cpp row permutation a tensor carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Permuted {
    No,
    /// q_proj: permuted with `n_head`.
    Q,
    /// k_proj: permuted with `n_head_kv`.
    K,
}

impl GgufFile {
    /// Every tensor under its Hugging Face name and shape, Q/K un-permuted (see [`GgufTensor`]).
    ///
    /// `rope_freqs.weight` is not returned (it is folded into [`config`](Self::config)'s RoPE
    /// scaling). Call [`config`](Self::config) first to have the shapes validated; this method
    /// only needs the head counts.
    pub fn hf_tensors(&self) -> Result<Vec<GgufTensor<'_>>> {
        let n_head = self.require_usize(&self.k("attention.head_count"))?;
        let n_head_kv = self
            .get_usize(&self.k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        let mut out = Vec::with_capacity(self.parsed.tensors.len());
        for t in &self.parsed.tensors {
            if t.name == "rope_freqs.weight" {
                continue;
            }
            let (name, perm) = hf_name_for(&t.name, self.arch.sandwich_norms).ok_or_else(|| {
                Error::tensor(
                    &self.path,
                    &t.name,
                    format!("not a tensor of the {} architecture", self.arch.name),
                )
            })?;
            let bytes = self.tensor_data(t);
            let shape = t.shape();
            let perm = if self.arch.permuted_qk {
                perm
            } else {
                Permuted::No
            };
            let data = match perm {
                Permuted::No => Cow::Borrowed(bytes),
                Permuted::Q | Permuted::K => {
                    let heads = if perm == Permuted::Q {
                        n_head
                    } else {
                        n_head_kv
                    };
                    let rows = shape[0];
                    unpermute_qk_rows(bytes, rows, heads)
                        .map(Cow::Owned)
                        .map_err(|msg| Error::tensor(&self.path, &t.name, msg))?
                }
            };
            out.push(GgufTensor {
                name,
                dtype: t.dtype,
                shape,
                data,
            });
        }
        Ok(out)
    }
}

/// `N` of a `blk.N.` tensor name.
pub(super) fn block_index(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The Hugging Face name of a GGUF llama tensor, and whether llama.cpp permuted its rows.
#[cfg(test)]
pub(super) fn hf_name(gguf: &str) -> Option<(String, Permuted)> {
    hf_name_for(gguf, false)
}

/// The Hugging Face name of a GGUF tensor of an architecture with or without Gemma's
/// sandwich norms, and whether llama.cpp permuted its rows (for llama).
pub(super) fn hf_name_for(gguf: &str, sandwich: bool) -> Option<(String, Permuted)> {
    let global = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = global {
        return Some((n.to_string(), Permuted::No));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (idx, rest) = rest.split_once('.')?;
    let i: usize = idx.parse().ok()?;
    if idx != i.to_string() {
        return None; // "blk.01." and friends
    }
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (hf, perm) = match part {
        "attn_norm" => ("input_layernorm", Permuted::No),
        "ffn_norm" if sandwich => ("pre_feedforward_layernorm", Permuted::No),
        "ffn_norm" => ("post_attention_layernorm", Permuted::No),
        "post_attention_norm" if sandwich => ("post_attention_layernorm", Permuted::No),
        "post_ffw_norm" if sandwich => ("post_feedforward_layernorm", Permuted::No),
        "attn_q" => ("self_attn.q_proj", Permuted::Q),
        "attn_k" => ("self_attn.k_proj", Permuted::K),
        "attn_v" => ("self_attn.v_proj", Permuted::No),
        "attn_output" => ("self_attn.o_proj", Permuted::No),
        "attn_q_norm" => ("self_attn.q_norm", Permuted::No),
        "attn_k_norm" => ("self_attn.k_norm", Permuted::No),
        "ffn_gate" => ("mlp.gate_proj", Permuted::No),
        "ffn_up" => ("mlp.up_proj", Permuted::No),
        "ffn_down" => ("mlp.down_proj", Permuted::No),
        _ => return None,
    };
    if suffix == "bias" && part.ends_with("norm") {
        return None;
    }
    Some((format!("model.layers.{i}.{hf}.{suffix}"), perm))
}

/// Undoes llama.cpp's rotary row permutation of a Q or K projection (weight or bias).
///
/// `convert_hf_to_gguf.py` stores `permute(W, n_head)`:
/// `W.reshape(n_head, 2, head_dim / 2, ...).swapaxes(1, 2).reshape(W.shape)`, so that RoPE can
/// rotate adjacent pairs. Within each head, file row `2 j + half` holds Hugging Face row
/// `half · head_dim/2 + j` (`half` ∈ {0, 1}, `j` < head_dim/2). This function returns the
/// Hugging Face order: `out[h·hd + half·hd/2 + j] = in[h·hd + 2j + half]`.
///
/// It moves whole rows of `bytes.len() / n_rows` bytes, so it works for any dtype, including
/// quantised blocks (a row is a whole number of blocks). Errors (as a message) when the rows
/// cannot be split into `n_head` heads of an even number of rows.
pub fn unpermute_qk_rows(bytes: &[u8], n_rows: usize, n_head: usize) -> Result<Vec<u8>, String> {
    let heads_ok = n_head
        .checked_mul(2)
        .is_some_and(|two_h| n_rows.is_multiple_of(two_h));
    if n_head == 0 || n_rows == 0 || !heads_ok || !bytes.len().is_multiple_of(n_rows) {
        return Err(format!(
            "cannot undo the rotary row permutation: {n_rows} rows ({} bytes) are not {n_head} heads of an even number of rows",
            bytes.len()
        ));
    }
    let row = bytes.len() / n_rows;
    let hd = n_rows / n_head;
    let half_hd = hd / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for j in 0..half_hd {
            for half in 0..2 {
                let src = h * hd + 2 * j + half;
                let dst = h * hd + half * half_hd + j;
                out[dst * row..(dst + 1) * row].copy_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    Ok(out)
}
