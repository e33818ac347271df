//! The reference KV cache: which rows survive (policy) and how they are held (storage).
//!
//! Policy (DESIGN.md §3): after each append, if more than `sink + window` rows are
//! stored, the oldest non-sink row is dropped, so exactly the first `sink` and the
//! last `window` tokens remain. Rows are kept in logical order (oldest first) with
//! their absolute positions stored explicitly.
//!
//! Storage (DESIGN.md §2), per row:
//! * fp32/fp16/bf16: the row cast on store (f16 saturating at ±65504), f32 on read.
//! * int8/int4 (KIVI, codes and packing as in [`crate::quant`]):
//!   - the first [`KvConfig::full_precision_rows`] tokens (`max(4, sink)`) keep K and V
//!     in f32;
//!   - every later V row is quantised at append, one `(scale, zero)` per KV head
//!     (over that head's `head_dim` values);
//!   - later K rows form groups of `group_size` consecutive tokens, counted from the
//!     end of the full-precision rows. A row of an incomplete group (the residual) is
//!     kept in f32. At the append of a group's last row, after that append's eviction,
//!     the group's still-stored rows are quantised together: one `(scale, zero)` per
//!     channel (`kv_dim` of them), fitted over those rows. Never re-quantised.
//!
//! `bytes()` counts what the rows hold: data, scales, zeros and full-precision rows;
//! a group's parameters count while at least one of its rows is stored.
//!
//! This version is written to be read, not to be fast: rows are `Vec`s and eviction
//! removes from the middle of a `Vec`.

use crate::quant::{f16_saturating, pack_codes, unpack_codes, Affine, Bits};
use half::{bf16, f16};
use std::collections::BTreeMap;

/// Tokens kept at full precision at the start of an int8/int4 cache (DESIGN.md §2).
pub const FULL_PRECISION_ROWS: usize = 4;

/// Storage precision of cached K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    Int8,
    Int4,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Int8,
        Precision::Int4,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
            Precision::Int4 => "int4",
        }
    }
    pub fn parse(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == s)
    }
    /// The KIVI code width, for int8/int4.
    pub fn kivi_bits(self) -> Option<Bits> {
        match self {
            Precision::Int8 => Some(Bits::Int8),
            Precision::Int4 => Some(Bits::Int4),
            _ => None,
        }
    }
}

/// Where RoPE is applied to keys (DESIGN.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PositionsMode {
    /// Keys are stored rotated to their original absolute position; the query uses its
    /// absolute position ("vanilla").
    Original,
    /// Keys are stored before RoPE and rotated by their slot index at attention time;
    /// the query is rotated by its own slot index (the StreamingLLM paper's scheme).
    Cache,
}

impl PositionsMode {
    pub fn name(self) -> &'static str {
        match self {
            PositionsMode::Original => "original",
            PositionsMode::Cache => "cache",
        }
    }
}

/// Cache policy × storage settings, shared by the reference and the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub precision: Precision,
    /// K quantisation group length in tokens (KIVI modes only).
    pub group_size: usize,
    /// StreamingLLM attention-sink tokens kept forever.
    pub sink: usize,
    /// StreamingLLM recent window; `None` means no eviction.
    pub window: Option<usize>,
    pub positions: PositionsMode,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            precision: Precision::Fp32,
            group_size: 32,
            sink: 0,
            window: None,
            positions: PositionsMode::Original,
        }
    }
}

impl KvConfig {
    /// Maximum rows held, if bounded.
    pub fn capacity(&self) -> Option<usize> {
        self.window.map(|w| self.sink + w)
    }
    /// Tokens at the start kept at full precision: `max(4, sink)` for int8/int4, else 0.
    pub fn full_precision_rows(&self) -> usize {
        match self.precision.kivi_bits() {
            Some(_) => self.sink.max(FULL_PRECISION_ROWS),
            None => 0,
        }
    }
}

/// One stored K or V row, `kv_dim` values.
#[derive(Debug, Clone)]
enum Stored {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// KIVI V: codes packed per KV head, one `(scale, zero)` per KV head.
    PerToken {
        codes: Vec<u8>,
        params: Vec<Affine>,
    },
    /// KIVI K of a complete group: codes; the parameters are the layer's `groups[group]`.
    PerChannel {
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
            Stored::PerToken { codes, params } => codes.len() + params.len() * 4,
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
    /// K group id → one `(scale, zero)` per channel (`kv_dim`), for complete groups
    /// that still have a stored row.
    groups: BTreeMap<usize, Vec<Affine>>,
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
        }
    }

    /// K group of append index `token`, if it is past the full-precision rows.
    fn group_of(&self, token: usize) -> Option<usize> {
        let first = self.cfg.full_precision_rows();
        (token >= first).then(|| (token - first) / self.cfg.group_size)
    }

    /// Appends one token's K and V rows (`kv_dim` each), then evicts per the policy,
    /// then quantises the K group this row completes, if any.
    pub fn append(&mut self, k: &[f32], v: &[f32], pos: usize) {
        assert_eq!(k.len(), self.kv_dim);
        assert_eq!(v.len(), self.kv_dim);
        let token = self.appended;
        self.appended += 1;
        let full_precision = token < self.cfg.full_precision_rows();
        let (ks, vs) = match (self.cfg.precision, self.cfg.precision.kivi_bits()) {
            (Precision::Fp32, _) => (Stored::F32(k.to_vec()), Stored::F32(v.to_vec())),
            (Precision::Fp16, _) => (to_f16(k), to_f16(v)),
            (Precision::Bf16, _) => (to_bf16(k), to_bf16(v)),
            (_, Some(_)) if full_precision => (Stored::F32(k.to_vec()), Stored::F32(v.to_vec())),
            // K waits in f32 until its group is complete; V is quantised now.
            (_, Some(bits)) => (Stored::F32(k.to_vec()), self.quantize_v(v, bits)),
            (_, None) => unreachable!("every precision is handled above"),
        };
        self.rows.push(Row {
            pos,
            token,
            k: ks,
            v: vs,
        });

        if let Some(cap) = self.cfg.capacity() {
            while self.rows.len() > cap {
                self.rows.remove(self.cfg.sink);
            }
        }

        if let (Some(bits), Some(g)) = (self.cfg.precision.kivi_bits(), self.group_of(token)) {
            let first = self.cfg.full_precision_rows();
            if (token - first + 1).is_multiple_of(self.cfg.group_size) {
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
        Stored::PerToken { codes, params }
    }

    /// Quantises K group `g` over its stored rows: per channel, fit over those rows.
    fn quantize_group(&mut self, g: usize, bits: Bits) {
        let members: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.group_of(self.rows[i].token) == Some(g))
            .collect();
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
                codes: pack_codes(&q, bits),
                group: g,
            };
        }
        self.groups.insert(g, params);
    }

    /// A stored row as f32.
    fn dequantize(&self, s: &Stored) -> Vec<f32> {
        let bits = self.cfg.precision.kivi_bits();
        match s {
            Stored::F32(x) => x.clone(),
            Stored::F16(x) => x.iter().map(|h| h.to_f32()).collect(),
            Stored::Bf16(x) => x.iter().map(|h| h.to_f32()).collect(),
            Stored::PerToken { codes, params } => {
                let bits = bits.expect("quantised rows only in int8/int4 caches");
                let q = unpack_codes(codes, self.kv_dim, bits);
                (0..self.kv_dim)
                    .map(|c| params[c / self.head_dim].dequantize(q[c], bits))
                    .collect()
            }
            Stored::PerChannel { codes, group } => {
                let bits = bits.expect("quantised rows only in int8/int4 caches");
                let q = unpack_codes(codes, self.kv_dim, bits);
                let params = &self.groups[group];
                (0..self.kv_dim)
                    .map(|c| params[c].dequantize(q[c], bits))
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
    /// Stored row `i`'s key, as f32 (`kv_dim` values).
    pub fn key(&self, i: usize) -> Vec<f32> {
        self.dequantize(&self.rows[i].k)
    }
    /// Stored row `i`'s value, as f32 (`kv_dim` values).
    pub fn value(&self, i: usize) -> Vec<f32> {
        self.dequantize(&self.rows[i].v)
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

fn to_f16(x: &[f32]) -> Stored {
    Stored::F16(x.iter().map(|&v| f16_saturating(v)).collect())
}

fn to_bf16(x: &[f32]) -> Stored {
    Stored::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect())
}
