//! The reference KV cache: which rows survive (policy) and how they are held (storage).
//!
//! Policy (docs/design.md §3): after each append, if more than `sink + window` rows are
//! stored, the oldest non-sink row is dropped, so exactly the first `sink` and the
//! last `window` tokens remain. Rows are kept in logical order (oldest first) with
//! their absolute positions stored explicitly.
//!
//! Storage (docs/design.md §2), per row. K and V each have a precision
//! ([`KvConfig::key_precision`], [`KvConfig::value_precision`]: `precision` unless
//! overridden for one side):
//! * fp32/fp16/bf16: the row cast on store (f16 saturating at ±65504), f32 on read.
//! * int8/int4/int2 (KIVI, codes and packing as in [`crate::quant`]):
//!   - when either side is KIVI, the first [`KvConfig::full_precision_rows`] tokens
//!     (`max(4, sink)`, the *prefix*) keep K and V in f32;
//!   - the newest `residual` (R) appended tokens of a KIVI side stay f32;
//!   - a later V row is quantised when it leaves the newest R (at the append of token
//!     `t + R`, after that append's eviction, if it is still stored), one `(scale, zero)`
//!     per KV head (over that head's `head_dim` values);
//!   - later K rows form groups of `group_size` (G) consecutive tokens, counted from the
//!     end of the prefix. Group `g` is quantised once, at the append after which
//!     `T − R ≥ P + (g + 1)·G` first holds (`T` rows appended, `P` the prefix length;
//!     for R = 0 that is the append of its G-th row), over its rows still stored after
//!     that append's eviction: one `(scale, zero)` per channel (`kv_dim` of them), fitted
//!     over those rows. Rows of groups not yet quantised stay f32. Never re-quantised.
//!   - a plain side (fp32/fp16/bf16) of a KIVI cache stores its body rows at its
//!     precision at append (R does not apply to it).
//! * Keys are stored after RoPE in `original` positions mode (`key_rope = post`), and
//!   before RoPE with `key_rope = pre` or in `cache` positions mode (then attention
//!   rotates each key at read time, see [`crate::attention`]).
//!
//! `bytes()` counts what the rows hold: data, scales, zeros and full-precision rows;
//! a group's parameters count while at least one of its rows is stored.
//!
//! This version is written to be read, not to be fast: rows are `Vec`s and eviction
//! removes from the middle of a `Vec`.

use crate::quant::{f16_saturating, pack_codes, unpack_codes, Affine, Bits};
use half::{bf16, f16};
use std::collections::BTreeMap;

/// The cache's configuration types, shared with the engine through `tinygpt-types`
/// (re-exported here, where the reference's readers look for them).
pub use tinygpt_types::kv::{
    KeyRope, KvConfig, KvRotation, PositionsMode, Precision, FULL_PRECISION_ROWS,
};

/// One stored K or V row, `kv_dim` values.
#[derive(Debug, Clone)]
enum Stored {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// KIVI V: codes packed per KV head, one `(scale, zero)` per KV head.
    PerToken {
        bits: Bits,
        codes: Vec<u8>,
        params: Vec<Affine>,
    },
    /// KIVI K of a quantised group: codes; the parameters are the layer's `groups[group]`.
    PerChannel {
        bits: Bits,
        codes: Vec<u8>,
        group: usize,
    },
}

impl Stored {
    fn bytes(&self) -> usize {
        match self {
            Stored::F32(x) => x.len() * 4,
            Stored::F16(x) => x.len() * 2,
            Stored::Bf16(x) => x.len() * 2,
            Stored::PerToken { codes, params, .. } => codes.len() + params.len() * 4,
            Stored::PerChannel { codes, .. } => codes.len(),
        }
    }
}

#[derive(Debug, Clone)]
struct Row {
    /// Absolute position.
    pos: usize,
    /// Append index (0 for the layer's first row).
    token: usize,
    k: Stored,
    v: Stored,
}

/// One layer's cache: all KV heads of every stored token.
#[derive(Debug, Clone)]
pub struct LayerCache {
    cfg: KvConfig,
    head_dim: usize,
    /// Width of one stored row: `n_kv_heads * head_dim`.
    kv_dim: usize,
    /// Stored rows, oldest first.
    rows: Vec<Row>,
    /// Rows appended so far.
    appended: usize,
    /// K group id → one `(scale, zero)` per channel (`kv_dim`), for quantised groups
    /// that still have a stored row.
    groups: BTreeMap<usize, Vec<Affine>>,
    /// The K and V rows of the last append as they arrived (before any cast or
    /// quantisation), for the differential probe ([`LayerCache::last_appended`]).
    last: (Vec<f32>, Vec<f32>),
}

impl LayerCache {
    pub fn new(cfg: &KvConfig, n_kv_heads: usize, head_dim: usize) -> Self {
        LayerCache {
            cfg: cfg.clone(),
            head_dim,
            kv_dim: n_kv_heads * head_dim,
            rows: Vec::new(),
            appended: 0,
            groups: BTreeMap::new(),
            last: (Vec::new(), Vec::new()),
        }
    }

    /// K group of append index `token`, if it is past the full-precision rows.
    fn group_of(&self, token: usize) -> Option<usize> {
        let first = self.cfg.full_precision_rows();
        (token >= first).then(|| (token - first) / self.cfg.group_size)
    }

    /// Appends one token's K and V rows (`kv_dim` each), then evicts per the policy,
    /// then quantises the V row and the K group that leave the newest R rows, if any.
    pub fn append(&mut self, k: &[f32], v: &[f32], pos: usize) {
        assert_eq!(k.len(), self.kv_dim);
        assert_eq!(v.len(), self.kv_dim);
        let token = self.appended;
        self.appended += 1;
        self.last = (k.to_vec(), v.to_vec());
        let prefix = self.cfg.full_precision_rows();
        let store = |x: &[f32], p: Precision| {
            if token < prefix {
                Stored::F32(x.to_vec())
            } else {
                store_row(x, p)
            }
        };
        self.rows.push(Row {
            pos,
            token,
            k: store(k, self.cfg.key_precision()),
            v: store(v, self.cfg.value_precision()),
        });

        if let Some(cap) = self.cfg.capacity() {
            while self.rows.len() > cap {
                self.rows.remove(self.cfg.sink);
            }
        }

        // The token that has just left the newest R rows.
        let Some(leaving) = self.appended.checked_sub(1 + self.cfg.residual) else {
            return;
        };
        if leaving < prefix {
            return;
        }
        if let Some(bits) = self.cfg.value_precision().kivi_bits() {
            if let Some(i) = self.rows.iter().position(|r| r.token == leaving) {
                let Stored::F32(x) = &self.rows[i].v else {
                    unreachable!("a KIVI V row stays f32 until it leaves the residual")
                };
                self.rows[i].v = self.quantize_v(x, bits);
            }
        }
        if let (Some(bits), Some(g)) =
            (self.cfg.key_precision().kivi_bits(), self.group_of(leaving))
        {
            if (leaving - prefix + 1).is_multiple_of(self.cfg.group_size) {
                self.quantize_group(g, bits);
            }
        }
        // Drop the parameters of groups that lost all their rows.
        let live: Vec<usize> = self
            .rows
            .iter()
            .filter_map(|r| match r.k {
                Stored::PerChannel { group, .. } => Some(group),
                _ => None,
            })
            .collect();
        self.groups.retain(|g, _| live.contains(g));
    }

    /// V row → codes packed per KV head, one `(scale, zero)` per KV head.
    fn quantize_v(&self, v: &[f32], bits: Bits) -> Stored {
        let mut codes = Vec::new();
        let mut params = Vec::new();
        for head in v.chunks(self.head_dim) {
            let a = Affine::fit(head, bits);
            let q: Vec<i32> = head.iter().map(|&x| a.quantize(x, bits)).collect();
            codes.extend(pack_codes(&q, bits));
            params.push(a);
        }
        Stored::PerToken {
            bits,
            codes,
            params,
        }
    }

    /// Quantises K group `g` over its stored rows: per channel, fit over those rows.
    /// A group none of whose rows is stored any more is skipped.
    fn quantize_group(&mut self, g: usize, bits: Bits) {
        let members: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.group_of(self.rows[i].token) == Some(g))
            .collect();
        if members.is_empty() {
            return;
        }
        let mut params = Vec::with_capacity(self.kv_dim);
        for c in 0..self.kv_dim {
            let channel: Vec<f32> = members
                .iter()
                .map(|&i| match &self.rows[i].k {
                    Stored::F32(x) => x[c],
                    _ => unreachable!("a group's rows stay f32 until it is quantised"),
                })
                .collect();
            params.push(Affine::fit(&channel, bits));
        }
        for &i in &members {
            let Stored::F32(x) = &self.rows[i].k else {
                unreachable!("a group's rows stay f32 until it is quantised")
            };
            let q: Vec<i32> = x
                .iter()
                .zip(&params)
                .map(|(&v, a)| a.quantize(v, bits))
                .collect();
            self.rows[i].k = Stored::PerChannel {
                bits,
                codes: pack_codes(&q, bits),
                group: g,
            };
        }
        self.groups.insert(g, params);
    }

    /// A stored row as f32.
    fn dequantize(&self, s: &Stored) -> Vec<f32> {
        match s {
            Stored::F32(x) => x.clone(),
            Stored::F16(x) => x.iter().map(|h| h.to_f32()).collect(),
            Stored::Bf16(x) => x.iter().map(|h| h.to_f32()).collect(),
            Stored::PerToken {
                bits,
                codes,
                params,
            } => {
                let q = unpack_codes(codes, self.kv_dim, *bits);
                (0..self.kv_dim)
                    .map(|c| params[c / self.head_dim].dequantize(q[c], *bits))
                    .collect()
            }
            Stored::PerChannel { bits, codes, group } => {
                let q = unpack_codes(codes, self.kv_dim, *bits);
                let params = &self.groups[group];
                (0..self.kv_dim)
                    .map(|c| params[c].dequantize(q[c], *bits))
                    .collect()
            }
        }
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    /// Rows appended since creation.
    pub fn appended(&self) -> usize {
        self.appended
    }
    /// Absolute position of stored row `i` (0 = oldest).
    pub fn position(&self, i: usize) -> usize {
        self.rows[i].pos
    }
    /// Absolute positions of the stored rows, oldest first.
    pub fn positions(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.pos).collect()
    }
    /// The K and V rows (`kv_dim` each) of the last append, as they arrived, before any
    /// cast or quantisation: what the differential probe compares with the engine's.
    #[doc(hidden)]
    pub fn last_appended(&self) -> (&[f32], &[f32]) {
        (&self.last.0, &self.last.1)
    }

    /// Stored row `i`'s key, as f32 (`kv_dim` values; before RoPE when
    /// [`KvConfig::keys_pre_rope`]).
    pub fn key(&self, i: usize) -> Vec<f32> {
        self.dequantize(&self.rows[i].k)
    }
    /// Stored row `i`'s value, as f32 (`kv_dim` values).
    pub fn value(&self, i: usize) -> Vec<f32> {
        self.dequantize(&self.rows[i].v)
    }
    /// Stored row `i`'s key as KIVI codes, when its group is quantised: the offset codes
    /// `u = q − qmin` (`kv_dim`) and the group's `(scale, zero)` per channel, so that
    /// `k_c = u_c · scale_c + zero_c`. `None` for a row held in f32 or f16/bf16.
    pub fn key_codes(&self, i: usize) -> Option<(Vec<u8>, &[Affine])> {
        match &self.rows[i].k {
            Stored::PerChannel { bits, codes, group } => Some((
                offset_codes(codes, self.kv_dim, *bits),
                self.groups.get(group)?.as_slice(),
            )),
            _ => None,
        }
    }

    /// Stored row `i`'s value as KIVI codes, when it is quantised: the offset codes
    /// (`kv_dim`) and one `(scale, zero)` per KV head.
    pub fn value_codes(&self, i: usize) -> Option<(Vec<u8>, &[Affine])> {
        match &self.rows[i].v {
            Stored::PerToken {
                bits,
                codes,
                params,
            } => {
                let per_head = bits.packed_len(self.head_dim);
                let u = codes
                    .chunks(per_head)
                    .flat_map(|c| offset_codes(c, self.head_dim, *bits))
                    .collect();
                Some((u, params.as_slice()))
            }
            _ => None,
        }
    }

    /// The `(scale, zero)` per channel of K group `g`, while it has a stored row.
    pub fn group_params(&self, g: usize) -> Option<&[Affine]> {
        self.groups.get(&g).map(|v| v.as_slice())
    }
    /// Bytes the stored rows hold: data, scales, zeros and full-precision rows.
    pub fn bytes(&self) -> usize {
        let rows: usize = self.rows.iter().map(|r| r.k.bytes() + r.v.bytes()).sum();
        rows + self.groups.len() * self.kv_dim * 4
    }
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }
}

/// The first `n` codes of `bytes` as offset codes `u = q − qmin`.
fn offset_codes(bytes: &[u8], n: usize, bits: Bits) -> Vec<u8> {
    unpack_codes(bytes, n, bits)
        .into_iter()
        .map(|q| (q - bits.qmin()) as u8)
        .collect()
}

/// How a new row of precision `p` is held at its append (after the prefix). A KIVI side
/// waits in f32 until it leaves the residual (then `quantize_v` / `quantize_group`); a
/// plain side is cast now. Adding a precision: its arm here, in `Stored` if it needs a
/// new form, and in `Precision`.
fn store_row(x: &[f32], p: Precision) -> Stored {
    match p {
        Precision::Fp32 => Stored::F32(x.to_vec()),
        Precision::Fp16 => to_f16(x),
        Precision::Bf16 => to_bf16(x),
        Precision::Int8 | Precision::Int4 | Precision::Int2 => Stored::F32(x.to_vec()),
    }
}

fn to_f16(x: &[f32]) -> Stored {
    Stored::F16(x.iter().map(|&v| f16_saturating(v)).collect())
}

fn to_bf16(x: &[f32]) -> Stored {
    Stored::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_per_element_and_names_round_trip() {
        let bits: Vec<u32> = Precision::ALL.iter().map(|p| p.bits()).collect();
        assert_eq!(bits, [32, 16, 16, 8, 4, 2]);
        for p in Precision::ALL {
            assert_eq!(Precision::parse(p.name()), Some(p));
            if let Some(b) = p.kivi_bits() {
                assert_eq!(b.width(), p.bits());
            }
        }
    }
}
