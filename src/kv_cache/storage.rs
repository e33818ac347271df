//! How stored rows are held: plain rows (f32/f16/bf16) and KIVI rows (int8/int4).
//!
//! Every buffer is split per KV head so one head's rows are contiguous (what a fused
//! attention kernel streams over); a *slot* is a row index inside these buffers.
//! Buffers grow lazily up to the slot written, so a bounded ring allocates at most
//! `window` slots and an unbounded cache grows amortised O(1) per row.
//!
//! ```text
//! Rows<E>        data[h]       (slots, head_dim)              E = f32 | f16 | bf16
//! TokenQuant     codes[h]      (slots, packed(head_dim))      V, offset-binary codes
//!                scale[h]      (slots)  f16                   one (scale, zero) per
//!                zero[h]       (slots)  f16                   token and KV head
//! ChannelQuant   codes[h]      (slots, packed(head_dim))      K, offset-binary codes
//!                scale[h]      (group_slots, head_dim) f16    one (scale, zero) per
//!                zero[h]       (group_slots, head_dim) f16    group and channel
//!                residual[h]   (group_size, head_dim) f32     incomplete group, row b % G
//! ```
//!
//! `packed(n)` is `n` bytes for int8 and `ceil(n / 2)` for int4, whose element `2j` is
//! the **low** nibble of byte `j` and element `2j + 1` the **high** nibble (see
//! [`crate::quant`]). Codes are never handed out: every read dequantises into f32.
//!
//! Invariants (`ChannelQuant`): a row's codes are valid only once its group is complete;
//! until then the row lives in `residual`. A group's `(scale, zero)` are written once,
//! when the group completes, and stay valid for every row of the group that is still
//! stored, whatever was evicted around it.

use crate::quant::{self, Bits};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// An element type for plain rows.
pub(crate) trait Elem: Copy + Default + Send + Sync + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Widens a slice (exact for every element type).
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(src) {
            *o = s.to_f32();
        }
    }
}

impl Elem for f32 {
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    /// Saturating, so a value just beyond f16's range does not become infinite.
    #[inline]
    fn from_f32(x: f32) -> Self {
        quant::f16_saturating(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        src.convert_to_f32_slice(out);
    }
}

impl Elem for bf16 {
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    /// bf16 is the top half of an f32: widening is a shift, as `bf16::to_f32` does for
    /// every value `bf16::from_f32` produces (it only differs on signalling NaNs).
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        for (o, s) in out.iter_mut().zip(src) {
            *o = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

/// Makes `buf` hold at least `len` elements (growing with `Default` values).
#[inline]
fn ensure<T: Copy + Default>(buf: &mut Vec<T>, len: usize) {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
}

/// Plain rows of one element type.
#[derive(Debug, Clone)]
pub(crate) struct Rows<E> {
    head_dim: usize,
    /// per KV head: (slots, head_dim)
    data: Vec<Vec<E>>,
}

impl<E: Elem> Rows<E> {
    fn new(kv_heads: usize, head_dim: usize) -> Self {
        Rows {
            head_dim,
            data: vec![Vec::new(); kv_heads],
        }
    }

    /// Stores a `(kv_heads, head_dim)` row at `slot`.
    fn write(&mut self, slot: usize, row: &[f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(row.len(), self.data.len() * hd);
        for (buf, src) in self.data.iter_mut().zip(row.chunks_exact(hd)) {
            ensure(buf, (slot + 1) * hd);
            for (d, &s) in buf[slot * hd..(slot + 1) * hd].iter_mut().zip(src) {
                *d = E::from_f32(s);
            }
        }
    }

    #[inline]
    fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(out.len(), hd);
        E::widen(&self.data[h][slot * hd..(slot + 1) * hd], out);
    }

    /// Bytes one stored row occupies across all heads.
    fn row_bytes(&self) -> usize {
        self.data.len() * self.head_dim * std::mem::size_of::<E>()
    }
}

/// Plain rows at the cache's precision.
#[derive(Debug, Clone)]
pub(crate) enum Plain {
    F32(Rows<f32>),
    F16(Rows<f16>),
    Bf16(Rows<bf16>),
}

macro_rules! plain_dispatch {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            Plain::F32($r) => $e,
            Plain::F16($r) => $e,
            Plain::Bf16($r) => $e,
        }
    };
}

/// Element type of a [`Plain`] store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlainKind {
    F32,
    F16,
    Bf16,
}

impl Plain {
    pub(crate) fn new(kind: PlainKind, kv_heads: usize, head_dim: usize) -> Self {
        match kind {
            PlainKind::F32 => Plain::F32(Rows::new(kv_heads, head_dim)),
            PlainKind::F16 => Plain::F16(Rows::new(kv_heads, head_dim)),
            PlainKind::Bf16 => Plain::Bf16(Rows::new(kv_heads, head_dim)),
        }
    }
    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        plain_dispatch!(self, r => r.write(slot, row))
    }
    #[inline]
    pub(crate) fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        plain_dispatch!(self, r => r.read(h, slot, out))
    }
    pub(crate) fn row_bytes(&self) -> usize {
        plain_dispatch!(self, r => r.row_bytes())
    }
}

/// KIVI V rows: quantised per token and KV head at append.
#[derive(Debug, Clone)]
pub(crate) struct TokenQuant {
    bits: Bits,
    head_dim: usize,
    /// packed bytes of one head's row
    packed: usize,
    /// per KV head: (slots, packed)
    codes: Vec<Vec<u8>>,
    /// per KV head: (slots)
    scale: Vec<Vec<f16>>,
    /// per KV head: (slots)
    zero: Vec<Vec<f16>>,
}

impl TokenQuant {
    pub(crate) fn new(bits: Bits, kv_heads: usize, head_dim: usize) -> Self {
        TokenQuant {
            bits,
            head_dim,
            packed: bits.packed_len(head_dim),
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
        }
    }

    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        let (hd, p) = (self.head_dim, self.packed);
        debug_assert_eq!(row.len(), self.codes.len() * hd);
        for (h, src) in row.chunks_exact(hd).enumerate() {
            ensure(&mut self.codes[h], (slot + 1) * p);
            ensure(&mut self.scale[h], slot + 1);
            ensure(&mut self.zero[h], slot + 1);
            let (s, z) =
                quant::quantize_token(src, self.bits, &mut self.codes[h][slot * p..(slot + 1) * p]);
            self.scale[h][slot] = s;
            self.zero[h][slot] = z;
        }
    }

    #[inline]
    pub(crate) fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        let p = self.packed;
        quant::dequantize_token(
            &self.codes[h][slot * p..(slot + 1) * p],
            self.scale[h][slot],
            self.zero[h][slot],
            self.bits,
            out,
        );
    }

    /// Bytes one stored row occupies across all heads: codes + scale + zero.
    pub(crate) fn row_bytes(&self) -> usize {
        self.codes.len() * (self.packed + 2 * std::mem::size_of::<f16>())
    }
}

/// KIVI K rows: quantised per channel over groups of `group_size` rows.
#[derive(Debug, Clone)]
pub(crate) struct ChannelQuant {
    bits: Bits,
    head_dim: usize,
    packed: usize,
    group_size: usize,
    /// per KV head: (slots, packed); valid only for rows of complete groups
    codes: Vec<Vec<u8>>,
    /// per KV head: (group_slots, head_dim)
    scale: Vec<Vec<f16>>,
    /// per KV head: (group_slots, head_dim)
    zero: Vec<Vec<f16>>,
    /// per KV head: (group_size, head_dim), row `b % group_size` of the incomplete group
    residual: Vec<Vec<f32>>,
}

impl ChannelQuant {
    pub(crate) fn new(bits: Bits, kv_heads: usize, head_dim: usize, group_size: usize) -> Self {
        debug_assert!(group_size > 0);
        ChannelQuant {
            bits,
            head_dim,
            packed: bits.packed_len(head_dim),
            group_size,
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
            residual: vec![Vec::new(); kv_heads],
        }
    }

    /// Stores body row `b` (its `b`-th row after the full-precision prefix) in the residual.
    pub(crate) fn write_residual(&mut self, b: usize, row: &[f32]) {
        let hd = self.head_dim;
        let r = b % self.group_size;
        for (buf, src) in self.residual.iter_mut().zip(row.chunks_exact(hd)) {
            ensure(buf, (r + 1) * hd);
            buf[r * hd..(r + 1) * hd].copy_from_slice(src);
        }
    }

    /// Quantises the complete group whose stored rows are body rows `rows` (a sub-range
    /// of the group): fits `(scale, zero)` per channel over those rows, stores them at
    /// `group_slot`, and writes each row's codes at `slot_of(b)`.
    pub(crate) fn complete_group(
        &mut self,
        rows: std::ops::Range<usize>,
        group_slot: usize,
        slot_of: impl Fn(usize) -> usize,
    ) {
        let (hd, p, g) = (self.head_dim, self.packed, self.group_size);
        debug_assert!(!rows.is_empty() && rows.len() <= g);
        debug_assert_eq!(rows.start / g, (rows.end - 1) / g, "rows span two groups");
        let mut lo = vec![f32::INFINITY; hd];
        let mut hi = vec![f32::NEG_INFINITY; hd];
        let mut s32 = vec![0.0f32; hd];
        let mut z32 = vec![0.0f32; hd];
        for h in 0..self.residual.len() {
            lo.fill(f32::INFINITY);
            hi.fill(f32::NEG_INFINITY);
            let res = &self.residual[h];
            for b in rows.clone() {
                let r = b % g;
                for (c, &x) in res[r * hd..(r + 1) * hd].iter().enumerate() {
                    lo[c] = lo[c].min(x);
                    hi[c] = hi[c].max(x);
                }
            }
            ensure(&mut self.scale[h], (group_slot + 1) * hd);
            ensure(&mut self.zero[h], (group_slot + 1) * hd);
            for c in 0..hd {
                let (s, z) = quant::params(lo[c], hi[c], self.bits);
                self.scale[h][group_slot * hd + c] = s;
                self.zero[h][group_slot * hd + c] = z;
                s32[c] = s.to_f32();
                z32[c] = z.to_f32();
            }
            for b in rows.clone() {
                let r = b % g;
                let slot = slot_of(b);
                ensure(&mut self.codes[h], (slot + 1) * p);
                quant::quantize_channels(
                    &res[r * hd..(r + 1) * hd],
                    &s32,
                    &z32,
                    self.bits,
                    &mut self.codes[h][slot * p..(slot + 1) * p],
                );
            }
        }
    }

    /// f32 copies of a group's parameters for KV head `h` (`head_dim` values each).
    #[inline]
    pub(crate) fn load_params(
        &self,
        h: usize,
        group_slot: usize,
        scale: &mut [f32],
        zero: &mut [f32],
    ) {
        let hd = self.head_dim;
        self.scale[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(scale);
        self.zero[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(zero);
    }

    /// Dequantises a row of a complete group, given its group's f32 parameters.
    #[inline]
    pub(crate) fn read_quant(
        &self,
        h: usize,
        slot: usize,
        scale: &[f32],
        zero: &[f32],
        out: &mut [f32],
    ) {
        let p = self.packed;
        quant::dequantize_channels(
            &self.codes[h][slot * p..(slot + 1) * p],
            scale,
            zero,
            self.bits,
            out,
        );
    }

    /// Reads body row `b` of the incomplete group.
    #[inline]
    pub(crate) fn read_residual(&self, h: usize, b: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        let r = b % self.group_size;
        out.copy_from_slice(&self.residual[h][r * hd..(r + 1) * hd]);
    }

    /// Bytes of one quantised row's codes across all heads.
    pub(crate) fn code_row_bytes(&self) -> usize {
        self.codes.len() * self.packed
    }
    /// Bytes of one residual row across all heads.
    pub(crate) fn residual_row_bytes(&self) -> usize {
        self.residual.len() * self.head_dim * std::mem::size_of::<f32>()
    }
    /// Bytes of one group's parameters across all heads: scale + zero per channel.
    pub(crate) fn group_bytes(&self) -> usize {
        self.scale.len() * self.head_dim * 2 * std::mem::size_of::<f16>()
    }
}
