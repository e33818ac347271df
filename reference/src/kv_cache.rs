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

/// Tokens kept at full precision at the start of a KIVI cache (docs/design.md §2).
pub const FULL_PRECISION_ROWS: usize = 4;

/// Storage precision of cached K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    Int8,
    Int4,
    Int2,
}

impl Precision {
    pub const ALL: [Precision; 6] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Int8,
        Precision::Int4,
        Precision::Int2,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
            Precision::Int4 => "int4",
            Precision::Int2 => "int2",
        }
    }
    pub fn parse(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == s)
    }
    /// Bits one stored element takes (codes only, without KIVI's scales and zeros).
    pub fn bits(self) -> u32 {
        match self {
            Precision::Fp32 => 32,
            Precision::Fp16 | Precision::Bf16 => 16,
            p => p.kivi_bits().map_or(32, Bits::width),
        }
    }
    /// The KIVI code width, for int8/int4/int2.
    pub fn kivi_bits(self) -> Option<Bits> {
        match self {
            Precision::Int8 => Some(Bits::Int8),
            Precision::Int4 => Some(Bits::Int4),
            Precision::Int2 => Some(Bits::Int2),
            _ => None,
        }
    }
}

/// Where RoPE positions come from (docs/design.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PositionsMode {
    /// Keys are rotated to their original absolute position; the query uses its
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

/// Whether keys are stored after RoPE (`Post`) or before it (`Pre`, rotated by their
/// stored absolute position at read time), in `original` positions mode. In `cache`
/// positions mode keys are always stored before RoPE, so this has no effect there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyRope {
    #[default]
    Post,
    Pre,
}

impl KeyRope {
    pub fn name(self) -> &'static str {
        match self {
            KeyRope::Post => "post",
            KeyRope::Pre => "pre",
        }
    }
    pub fn parse(s: &str) -> Option<KeyRope> {
        match s {
            "post" => Some(KeyRope::Post),
            "pre" => Some(KeyRope::Pre),
            _ => None,
        }
    }
}

/// An orthogonal rotation applied to each head's keys and values before they are stored
/// (docs/design.md §2.5): `Hadamard` stores `H·k` and `H·v` with `H` the normalised
/// Walsh–Hadamard matrix of the head dimension, rotates each query head by `H` (so
/// `(H·q)·(H·k) = q·k`), and multiplies each head's attention output by `H` (`H·H = I`).
/// It spreads outlier channels across the head before KIVI quantises them.
///
/// `Auto` (the default) rotates when it pays: K or V is KIVI-quantised, keys are stored
/// after RoPE (with pre-RoPE keys every stored key would be un-rotated at each read) and
/// the head dimension is a power of two; [`KvConfig::rotates`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvRotation {
    #[default]
    Auto,
    None,
    Hadamard,
}

impl KvRotation {
    pub fn name(self) -> &'static str {
        match self {
            KvRotation::Auto => "auto",
            KvRotation::None => "none",
            KvRotation::Hadamard => "hadamard",
        }
    }
    pub fn parse(s: &str) -> Option<KvRotation> {
        match s {
            "auto" => Some(KvRotation::Auto),
            "none" => Some(KvRotation::None),
            "hadamard" => Some(KvRotation::Hadamard),
            _ => None,
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
    /// Overrides `precision` for K.
    pub k_precision: Option<Precision>,
    /// Overrides `precision` for V.
    pub v_precision: Option<Precision>,
    /// KIVI residual R: the newest R appended tokens of a KIVI side stay f32.
    pub residual: usize,
    /// Keys stored before or after RoPE in `original` positions mode.
    pub key_rope: KeyRope,
    /// Rotation of K and V before they are stored.
    pub rotation: KvRotation,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            precision: Precision::Fp32,
            group_size: 32,
            sink: 0,
            window: None,
            positions: PositionsMode::Original,
            k_precision: None,
            v_precision: None,
            residual: 0,
            key_rope: KeyRope::Post,
            rotation: KvRotation::Auto,
        }
    }
}

impl KvConfig {
    /// Maximum rows held, if bounded.
    pub fn capacity(&self) -> Option<usize> {
        self.window.map(|w| self.sink + w)
    }
    /// K's storage precision.
    pub fn key_precision(&self) -> Precision {
        self.k_precision.unwrap_or(self.precision)
    }
    /// V's storage precision.
    pub fn value_precision(&self) -> Precision {
        self.v_precision.unwrap_or(self.precision)
    }
    /// Whether K or V is stored as KIVI codes.
    pub fn is_kivi(&self) -> bool {
        self.key_precision().kivi_bits().is_some() || self.value_precision().kivi_bits().is_some()
    }
    /// Tokens at the start kept at full precision: `max(4, sink)` when K or V is KIVI,
    /// else 0.
    pub fn full_precision_rows(&self) -> usize {
        if self.is_kivi() {
            self.sink.max(FULL_PRECISION_ROWS)
        } else {
            0
        }
    }
    /// Whether K and V are stored Hadamard-rotated in a model with this head dimension
    /// (docs/design.md §2.5): always for `Hadamard`, never for `None`, and for `Auto` when
    /// a side is KIVI-quantised, keys are stored after RoPE and `head_dim` is a power of two.
    pub fn rotates(&self, head_dim: usize) -> bool {
        match self.rotation {
            KvRotation::None => false,
            KvRotation::Hadamard => true,
            KvRotation::Auto => {
                self.is_kivi() && !self.keys_pre_rope() && crate::hadamard::supported(head_dim)
            }
        }
    }
    /// Whether stored keys are before RoPE (rotated at read time).
    pub fn keys_pre_rope(&self) -> bool {
        self.positions == PositionsMode::Cache || self.key_rope == KeyRope::Pre
    }
    /// Short name: the precision, or `kXvY` when the sides differ (e.g. `k8v4`,
    /// `kfp16vint4`), with `+rR` for a residual, `+pre` for pre-RoPE keys, and `+rot` /
    /// `+norot` when the rotation is forced on / off (nothing for `auto`).
    pub fn quant_name(&self) -> String {
        let (k, v) = (self.key_precision(), self.value_precision());
        let bits = |p: Precision| match p.kivi_bits() {
            Some(b) => b.width().to_string(),
            None => p.name().to_string(),
        };
        let mut s = if k == v {
            k.name().to_string()
        } else {
            format!("k{}v{}", bits(k), bits(v))
        };
        if self.residual > 0 {
            s += &format!("+r{}", self.residual);
        }
        if self.key_rope == KeyRope::Pre {
            s += "+pre";
        }
        match self.rotation {
            KvRotation::Hadamard => s += "+rot",
            KvRotation::None if self.is_kivi() => s += "+norot",
            _ => {}
        }
        s
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
    /// Stored row `i`'s key, as f32 (`kv_dim` values; before RoPE when
    /// [`KvConfig::keys_pre_rope`]).
    /// The K and V rows (`kv_dim` each) of the last append, as they arrived, before any
    /// cast or quantisation: what the differential probe compares with the engine's.
    #[doc(hidden)]
    pub fn last_appended(&self) -> (&[f32], &[f32]) {
        (&self.last.0, &self.last.1)
    }

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
