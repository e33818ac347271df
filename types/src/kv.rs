//! The KV cache configuration shared by the reference and the engine: which rows a layer
//! keeps (StreamingLLM `sink` + `window`, [`PositionsMode`]), how they are stored
//! ([`Precision`], KIVI's group size and residual, [`KeyRope`], [`KvRotation`]), and the
//! KIVI code widths ([`Bits`], named ranges: docs/design.md §2.3). Data, parsing and the
//! derived settings; how a cache quantises and attends is each crate's own code.

/// int8 codes: `q ∈ [INT8_QMIN, INT8_QMAX]`.
pub const INT8_QMIN: i32 = -128;
pub const INT8_QMAX: i32 = 127;
/// int4 codes: `q ∈ [INT4_QMIN, INT4_QMAX]`.
pub const INT4_QMIN: i32 = -8;
pub const INT4_QMAX: i32 = 7;
/// int2 codes: `q ∈ [INT2_QMIN, INT2_QMAX]`.
pub const INT2_QMIN: i32 = -2;
pub const INT2_QMAX: i32 = 1;

/// A KIVI code width: the one definition, shared by the engine and the reference (each
/// re-exports it). Adding a width: its arm here and in the methods below, then in each
/// crate's code packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    Int8,
    Int4,
    Int2,
}

impl Bits {
    pub fn qmin(self) -> i32 {
        match self {
            Bits::Int8 => INT8_QMIN,
            Bits::Int4 => INT4_QMIN,
            Bits::Int2 => INT2_QMIN,
        }
    }
    pub fn qmax(self) -> i32 {
        match self {
            Bits::Int8 => INT8_QMAX,
            Bits::Int4 => INT4_QMAX,
            Bits::Int2 => INT2_QMAX,
        }
    }
    /// Bits per code.
    pub fn width(self) -> u32 {
        (self.qmax() - self.qmin() + 1).ilog2()
    }
    /// Bytes holding `n` packed codes.
    pub fn packed_len(self, n: usize) -> usize {
        match self {
            Bits::Int8 => n,
            Bits::Int4 => n.div_ceil(2),
            Bits::Int2 => n.div_ceil(4),
        }
    }
}

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
                self.is_kivi() && !self.keys_pre_rope() && hadamard_supported(head_dim)
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

/// Whether a head dimension `d` has a Walsh–Hadamard rotation (a power of two, at least 2):
/// [`KvRotation::Auto`] rotates only then, and both crates' rotations accept exactly these.
pub fn hadamard_supported(d: usize) -> bool {
    d >= 2 && d.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for p in Precision::ALL {
            assert_eq!(Precision::parse(p.name()), Some(p));
        }
        for k in [KeyRope::Post, KeyRope::Pre] {
            assert_eq!(KeyRope::parse(k.name()), Some(k));
        }
        for r in [KvRotation::Auto, KvRotation::None, KvRotation::Hadamard] {
            assert_eq!(KvRotation::parse(r.name()), Some(r));
        }
        assert_eq!(Precision::parse("int3"), None);
    }

    #[test]
    fn widths_and_derived_settings() {
        assert_eq!(
            [Bits::Int8, Bits::Int4, Bits::Int2].map(Bits::width),
            [8, 4, 2]
        );
        assert_eq!(Bits::Int4.packed_len(5), 3);
        assert_eq!(Precision::Int4.bits(), 4);
        assert_eq!(Precision::Bf16.bits(), 16);
        let kv = KvConfig {
            precision: Precision::Int4,
            sink: 2,
            window: Some(10),
            residual: 8,
            ..KvConfig::default()
        };
        assert_eq!(kv.capacity(), Some(12));
        assert_eq!(kv.full_precision_rows(), FULL_PRECISION_ROWS);
        assert!(kv.rotates(64) && !kv.rotates(48));
        assert_eq!(kv.quant_name(), "int4+r8");
        assert!(!KvConfig::default().is_kivi());
        assert!(hadamard_supported(2) && !hadamard_supported(1) && !hadamard_supported(0));
    }
}
