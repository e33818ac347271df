//! Dot products of GGML-quantised weights (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL) with an activation vector
//! quantised to 8 bits per block, as llama.cpp does: a 4-bit model reads 4-bit weights.
//!
//! Numerics are exactly those of `tinygpt_reference::ggml_dot` (read its header): every
//! block's integer sum is exact, and each row's float terms are combined in the same
//! order, with the same operations (no fused multiply-add), so every kernel variant here
//! equals the scalar twin **bit for bit**.
//!
//! # Layout: eight rows interleaved per block ([`Packed`])
//!
//! At load, a matrix is repacked into groups of eight rows. Within a group, block `b` of
//! the eight rows is stored together, so one activation block meets eight weight rows and
//! the eight per-block integer sums are reduced together into one vector whose lane `k`
//! is row `k` (one row's float chain per lane: the reference's order). Per group:
//!
//! * `qs`: `nb` 8-row blocks of codes, 128 bytes (Q4_0/Q4_1/IQ4_NL), 160 bytes (Q5_0: the 128
//!   bytes of nibbles, then 32 bytes of fifth bits) or 256 bytes (Q8_0) each;
//! * `d`: `nb × 8` f16 scales (16 bytes per block);
//! * `m`: `nb × 8` f16 minimums (Q4_1 only);
//!
//! padded to a 64-byte boundary. Inside an 8-row block of codes, rows 0–3 come first,
//! then rows 4–7, so a 64-byte vector holds four rows:
//!
//! * Q4 (and IQ4_NL): bytes `[(r / 4)·64 + (r % 4)·16 ..][..16]` are row `r`'s 16 nibble
//!   bytes as in the file (element `i < 16` in the low nibble of byte `i`, element `i + 16`
//!   in its high nibble; IQ4_NL's nibble `n` stands for the level `K[n]`,
//!   `tinygpt_reference::ggml_more::IQ4_VALUES`);
//! * Q8: byte `(r / 4)·128 + (i / 16)·64 + (r % 4)·16 + i % 16` is row `r`'s element `i`;
//! * Q5_0: the nibbles as Q4's; then, at `128 + (r / 4)·16 + (i / 16)·8 + (r % 4)·2`, the
//!   little-endian `u16` whose bit `i % 16` is the fifth bit of row `r`'s element `i` (the
//!   low or high half of the block's `qh`). So each 8 bytes are the four fifth-bit masks of
//!   one 64-byte nibble vector (rows 0–3 or 4–7, elements 0..16 or 16..32), in its row
//!   order: one 64-bit mask for AVX-512 (`k` register), one 32-bit word per row pair for
//!   AVX2.
//!
//! # Q5_0, IQ4_NL: kept as blocks where a variant has code for them
//!
//! A Q5_0 matrix is packed as Q5_0 (22 bytes per 32 weights, its 5-bit codes and scales as
//! in the file) for the variants with Q5_0 code ([`Kernel::has_q5_0`]: all of them since
//! `portable` got its own); a variant without it would get the matrix rewritten exactly as
//! Q8_0 when packed (`tinygpt_reference::ggml_more::q5_0_to_q8_0`; same codes, same
//! products), so [`Packed::dtype`] says which form a matrix holds. Either way every value
//! equals `tinygpt_reference::ggml_dot::dot_q5_0` bit for bit.
//!
//! IQ4_NL likewise ([`Kernel::has_iq4_nl`]): packed as its own blocks (18 bytes per 32
//! weights; the nibbles in Q4's layout, looked up in the 16 levels by the kernels) for the
//! variants with IQ4_NL code, else rewritten exactly as Q8_0 when packed
//! (`tinygpt_reference::ggml_more::iq4_nl_to_q8_0`); every value equals
//! `tinygpt_reference::ggml_dot::dot_iq4_nl` bit for bit.
//!
//! # Kernels, chosen once at run time
//!
//! [`Kernel`] names the variants; [`active`] is the one the engine uses: the best the CPU
//! supports (`is_x86_feature_detected!` / `is_aarch64_feature_detected!`), or the one
//! named by the environment variable `TINYGPT_KERNEL` (`scalar`, `portable`, `avx2`,
//! `avx512vnni`, `neon-dotprod`) when the CPU supports it. Tests call every supported
//! variant directly through [`dot_group`].
//!
//! * `scalar`: plain Rust loops, the reference's steps one row at a time (the twin the
//!   others are tested against; not a speed target);
//! * `portable` (`super::portable`): `wide` vectors only, no `std::arch`, so it builds
//!   and runs on every target; the best variant of a CPU with neither AVX2 nor the Arm
//!   dot-product extension. Its speed depends on the vector width the build enables
//!   (`.cargo/config.toml` builds for the host CPU);
//! * `avx2`, `avx512vnni` (`super::x86`), `neon-dotprod` (`super::aarch64`): one
//!   instruction set each, behind run-time detection.

use super::simd::load8;
use crate::dtype::DType;
use half::f16;
use std::sync::OnceLock;
use tinygpt_reference::ggml_kdot::Q8K;
use tinygpt_reference::ggml_more::IQ4_VALUES;
use wide::{f32x8, i32x8, CmpGe, CmpLe};

/// Values per block.
pub const QK: usize = 32;
/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// An activation vector quantised to 8 bits per block.
#[derive(Debug, Clone, Default)]
pub struct QuantizedActs {
    /// Per block: scale `d_x`.
    pub d: Vec<f32>,
    /// Per block: `d_x · Σ q_x` (for Q4_1's min term).
    pub s: Vec<f32>,
    /// Per block: `Σ q_x` (integer; the kernels' offset corrections use it).
    pub qsum: Vec<i32>,
    /// Codes in `[-127, 127]`, one per value.
    pub q: Vec<i8>,
    /// The same vector as Q8_K super-blocks of 256 (for Q4_K / Q6_K weights: see
    /// [`super::kquant`]); empty when the length is not a multiple of 256.
    pub k: Q8K,
}

/// Which quantised forms of an activation vector the matrices reading it need: 8-bit
/// blocks of 32 (Q8_0, Q4_0, Q4_1) and/or Q8_K super-blocks (Q4_K, Q5_K, Q6_K, IQ4_XS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActsForms {
    pub q8_0: bool,
    pub q8_k: bool,
}

impl ActsForms {
    /// Both forms.
    pub const ALL: ActsForms = ActsForms {
        q8_0: true,
        q8_k: true,
    };

    /// The form a matrix of `dtype` reads (none for float types).
    pub fn of(dtype: DType) -> ActsForms {
        let k = super::kquant::is_kquant(dtype);
        ActsForms {
            q8_0: dtype.is_quantized() && !k,
            q8_k: k,
        }
    }

    /// Both sets of forms.
    pub fn union(self, o: ActsForms) -> ActsForms {
        ActsForms {
            q8_0: self.q8_0 || o.q8_0,
            q8_k: self.q8_k || o.q8_k,
        }
    }

    /// Whether any form is needed.
    pub fn any(self) -> bool {
        self.q8_0 || self.q8_k
    }
}

impl QuantizedActs {
    /// Quantises `x` (length a multiple of 32) into both forms ([`ActsForms::ALL`]).
    pub fn quantize(&mut self, x: &[f32]) {
        self.quantize_forms(x, ActsForms::ALL);
    }

    /// Quantises `x` into the forms `forms` names; the others are left empty (a kernel
    /// that would read them asserts their lengths). The Q8_K form exists only when the
    /// length is a multiple of 256.
    pub fn quantize_forms(&mut self, x: &[f32], forms: ActsForms) {
        if forms.q8_0 {
            self.quantize_q8_0(x);
        } else {
            self.d.clear();
            self.s.clear();
            self.qsum.clear();
            self.q.clear();
        }
        if forms.q8_k {
            super::kquant::quantize_into(x, &mut self.k);
        } else {
            super::kquant::quantize_into(&[], &mut self.k);
        }
    }

    /// The 8-bit blocks of 32: same rounding as the reference twin (`round` half away
    /// from zero, then clamped to ±127; NaN codes 0), eight lanes at a time.
    fn quantize_q8_0(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % QK, 0);
        let nb = x.len() / QK;
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.qsum.resize(nb, 0);
        self.q.resize(x.len(), 0);
        let (half, one, lim) = (f32x8::splat(0.5), f32x8::ONE, f32x8::splat(128.0));
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let v: [f32x8; 4] = std::array::from_fn(|i| load8(&blk[i * 8..]));
            // `wide`'s `max` ignores a NaN lane as `f32::max` does; the maximum of the
            // other values does not depend on the order.
            let amax = v
                .iter()
                .fold(f32x8::ZERO, |m, vi| m.max(vi.abs()))
                .to_array()
                .into_iter()
                .fold(0.0f32, f32::max);
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let idv = f32x8::splat(id);
            let mut sum = i32x8::ZERO;
            for (vi, out) in v
                .iter()
                .zip(self.q[b * QK..(b + 1) * QK].chunks_exact_mut(8))
            {
                // NaN codes 0 (as `NaN as i32`); the rest is clamped to ±128, then rounded
                // half away from zero exactly (`y − trunc(y)` is exact for |y| ≤ 128).
                let y = *vi * idv;
                let y = y.is_nan().blend(f32x8::ZERO, y).max(-lim).min(lim);
                let t = y.trunc_int();
                let frac = y - t.round_float();
                let up = frac.cmp_ge(half).blend(one, f32x8::ZERO)
                    - frac.cmp_le(-half).blend(one, f32x8::ZERO);
                let q = (t + up.round_int())
                    .max(i32x8::splat(-127))
                    .min(i32x8::splat(127));
                sum += q;
                for (o, qi) in out.iter_mut().zip(q.to_array()) {
                    *o = qi as i8;
                }
            }
            let sum = sum.reduce_add();
            self.d[b] = d;
            self.s[b] = d * sum as f32;
            self.qsum[b] = sum;
        }
    }

    pub fn from_f32(x: &[f32]) -> Self {
        let mut a = QuantizedActs::default();
        a.quantize(x);
        a
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }
}

/// A kernel variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust loops over the packed layout (every CPU).
    Scalar,
    /// `wide` vectors (`i16x16` pair products): every CPU, any target.
    Portable,
    /// x86_64 AVX2 (`vpmaddubsw` + `vpmaddwd`), F16C for the scales.
    Avx2,
    /// x86_64 AVX-512 BW + VNNI (`vpdpbusd` on 512-bit vectors).
    Avx512Vnni,
    /// aarch64 NEON with the dot-product extension (`sdot`).
    NeonDotprod,
}

impl Kernel {
    /// Every variant, slowest first.
    pub const ALL: [Kernel; 5] = [
        Kernel::Scalar,
        Kernel::Portable,
        Kernel::Avx2,
        Kernel::Avx512Vnni,
        Kernel::NeonDotprod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512Vnni => "avx512vnni",
            Kernel::NeonDotprod => "neon-dotprod",
        }
    }

    pub fn from_name(s: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether this CPU can run the variant (run-time detection).
    pub fn is_supported(self) -> bool {
        match self {
            Kernel::Scalar | Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Kernel::NeonDotprod => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether the variant has Q5_0 code (else a Q5_0 matrix is packed as Q8_0 for it:
    /// module docs).
    pub fn has_q5_0(self) -> bool {
        matches!(
            self,
            Kernel::Scalar
                | Kernel::Portable
                | Kernel::Avx2
                | Kernel::Avx512Vnni
                | Kernel::NeonDotprod
        )
    }

    /// Whether the variant has IQ4_NL code (else an IQ4_NL matrix is packed as Q8_0 for
    /// it: module docs).
    pub fn has_iq4_nl(self) -> bool {
        matches!(
            self,
            Kernel::Scalar
                | Kernel::Portable
                | Kernel::Avx2
                | Kernel::Avx512Vnni
                | Kernel::NeonDotprod
        )
    }

    /// Whether the variant reads blocks of `dtype` as they are packed: false only for
    /// Q5_0 / IQ4_NL in a variant without code for them (their matrices are packed as
    /// Q8_0 for it; [`Packed::new_for`]).
    pub fn reads(self, dtype: DType) -> bool {
        match dtype {
            DType::Q5_0 => self.has_q5_0(),
            DType::IQ4_NL => self.has_iq4_nl(),
            _ => true,
        }
    }

    /// The variants this CPU supports, slowest first.
    pub fn supported() -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The fastest supported variant.
    pub fn best() -> Kernel {
        *Kernel::supported()
            .last()
            .expect("scalar is always supported")
    }
}

/// The variant the engine uses, chosen once: `TINYGPT_KERNEL` if it names a supported
/// variant, else [`Kernel::best`].
pub fn active() -> Kernel {
    static ACTIVE: OnceLock<Kernel> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        std::env::var("TINYGPT_KERNEL")
            .ok()
            .and_then(|s| Kernel::from_name(s.trim()))
            .filter(|k| k.is_supported())
            .unwrap_or_else(Kernel::best)
    })
}

/// One 64-byte line of a packed matrix (keeps every group 64-byte aligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

// SAFETY: `Line` is a byte array with alignment 64 and size 64: no padding, every bit
// pattern valid, all-zero valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

/// The packed bytes: zeroed, 64-byte aligned (every group starts on a cache line).
///
/// From [`HUGE_MIN`] bytes up they live in an anonymous mapping that Linux is asked to
/// back with transparent huge pages (`madvise(MADV_HUGEPAGE)`; the system default here is
/// `madvise`, so without asking a heap buffer gets 4 KiB pages). A matvec streams the
/// whole buffer every token: a Q4_1 16384x8192 matvec from DRAM took 7.4–10.3 ms with
/// 4 KiB pages and 5.5 ms with 2 MiB pages (benches/README.md, "Q4_1 out of DRAM"): the
/// page walks, not the bytes, bounded it.
/// Where the advice is refused or THP is off, the mapping simply keeps 4 KiB pages.
enum PackedBuf {
    Lines(Vec<Line>),
    Map(memmap2::MmapMut),
}

/// Packed matrices at least this large are put in huge-page-advised mappings (one 2 MiB
/// page; a smaller buffer could not use one).
const HUGE_MIN: usize = 2 << 20;

impl PackedBuf {
    fn zeroed(len: usize) -> PackedBuf {
        if cfg!(target_os = "linux") && len >= HUGE_MIN {
            // An anonymous mapping is zeroed and page aligned (so 64-byte aligned).
            if let Ok(m) = memmap2::MmapMut::map_anon(len) {
                #[cfg(target_os = "linux")]
                let _ = m.advise(memmap2::Advice::HugePage);
                return PackedBuf::Map(m);
            }
        }
        PackedBuf::Lines(vec![Line([0; 64]); len / 64])
    }

    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        match self {
            PackedBuf::Lines(v) => bytemuck::cast_slice(v),
            PackedBuf::Map(m) => m,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            PackedBuf::Lines(v) => bytemuck::cast_slice_mut(v),
            PackedBuf::Map(m) => m,
        }
    }
}

/// Bytes of one 8-row block of codes (Q5_0: nibbles, then fifth bits).
pub(crate) fn qs_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q8_0 => 256,
        DType::Q5_0 => 160,
        DType::Q4_0 | DType::Q4_1 | DType::IQ4_NL => 128,
        other => unreachable!("packed {other}"),
    }
}

/// Position of row `r`'s element `i` (Q8_0) or of the byte holding its nibble (Q4, Q5_0:
/// element `i` and `i + 16` share a byte) inside an 8-row block of codes.
#[inline(always)]
fn code_pos(dtype: DType, r: usize, i: usize) -> usize {
    match dtype {
        DType::Q8_0 => (r / 4) * 128 + (i / 16) * 64 + (r % 4) * 16 + i % 16,
        _ => (r / 4) * 64 + (r % 4) * 16 + i % 16,
    }
}

/// Position of the `u16` of row `r`'s fifth bits of elements `16·half..16·half + 16`
/// inside a Q5_0 8-row block of codes.
#[inline(always)]
fn q5_bits_pos(r: usize, half: usize) -> usize {
    128 + (r / 4) * 16 + half * 8 + (r % 4) * 2
}

/// A GGML-block matrix repacked into interleaved groups of [`GROUP`] rows (module docs).
pub struct Packed {
    /// The type of the packed blocks: the file's, except a Q5_0 or IQ4_NL matrix packed
    /// for a variant without code for it, which holds Q8_0.
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row.
    nb: usize,
    /// Bytes per group (a multiple of 64).
    group_bytes: usize,
    data: PackedBuf,
}

/// One group's regions.
pub struct Group<'a> {
    pub qs: &'a [u8],
    pub d: &'a [u8],
    pub m: &'a [u8],
    pub nb: usize,
    /// The matrix streams from DRAM every token ([`STREAM_PREFETCH_BYTES`] or more): the
    /// one-token x86 kernels prefetch ahead in it.
    pub stream: bool,
}

/// Packed matrices of at least this many bytes do not stay in a last-level cache between
/// tokens, so their one-token kernels prefetch ahead (measured to help there and to hurt
/// on SmolLM2's cache-sized matrices: benches/README.md, "Q4_1 out of DRAM").
pub const STREAM_PREFETCH_BYTES: usize = 64 << 20;

impl Packed {
    /// Repacks row-major GGML rows (`rows × cols`, validated lengths) for the engine's
    /// kernel variant ([`active`]; see [`Packed::new_for`]).
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Packed {
        Packed::new_for(active(), dtype, rows, cols, bytes)
    }

    /// Repacks row-major GGML rows (`rows × cols`, validated lengths) for `kernel`: Q5_0
    /// (IQ4_NL) stays Q5_0 (IQ4_NL) if the variant has code for it ([`Kernel::reads`]),
    /// else it becomes Q8_0 (exact; module docs). Rows past the end of the last group are zero (scale 0)
    /// and their results are never read. Any variant can read any packed matrix (one
    /// without code for its type runs the scalar loop).
    pub fn new_for(kernel: Kernel, dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Packed {
        if super::kquant::is_row_packed(dtype) {
            return Packed::new_rows(dtype, rows, cols, bytes);
        }
        if !kernel.reads(dtype) {
            let q8 = match dtype {
                DType::Q5_0 => tinygpt_reference::ggml_more::q5_0_to_q8_0(bytes),
                _ => tinygpt_reference::ggml_more::iq4_nl_to_q8_0(bytes),
            };
            return Packed::new_for(kernel, DType::Q8_0, rows, cols, &q8);
        }
        let nb = cols / QK;
        let bs = dtype.block_bytes();
        let row_bytes = nb * bs;
        debug_assert_eq!(bytes.len(), rows * row_bytes);
        let qsb = qs_bytes(dtype);
        let mins = dtype == DType::Q4_1;
        let raw = nb * (qsb + 16 + if mins { 16 } else { 0 });
        let group_bytes = raw.next_multiple_of(64);
        let groups = rows.div_ceil(GROUP);
        let mut data = PackedBuf::zeroed(groups * group_bytes);
        let out: &mut [u8] = data.bytes_mut();
        for r in 0..rows {
            let (g, k) = (r / GROUP, r % GROUP);
            let dst = &mut out[g * group_bytes..(g + 1) * group_bytes];
            let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
            for (b, blk) in row.chunks_exact(bs).enumerate() {
                let qs = &mut dst[b * qsb..(b + 1) * qsb];
                match dtype {
                    DType::Q8_0 => {
                        for i in 0..QK {
                            qs[code_pos(dtype, k, i)] = blk[2 + i];
                        }
                    }
                    DType::Q5_0 => {
                        for i in 0..16 {
                            qs[code_pos(dtype, k, i)] = blk[6 + i];
                        }
                        for half in 0..2 {
                            let at = q5_bits_pos(k, half);
                            qs[at..at + 2].copy_from_slice(&blk[2 + 2 * half..4 + 2 * half]);
                        }
                    }
                    _ => {
                        let off = if mins { 4 } else { 2 };
                        for i in 0..16 {
                            qs[code_pos(dtype, k, i)] = blk[off + i];
                        }
                    }
                }
                let d_at = nb * qsb + b * 16 + k * 2;
                dst[d_at..d_at + 2].copy_from_slice(&blk[0..2]);
                if mins {
                    let m_at = nb * qsb + nb * 16 + b * 16 + k * 2;
                    dst[m_at..m_at + 2].copy_from_slice(&blk[2..4]);
                }
            }
        }
        Packed {
            dtype,
            rows,
            cols,
            nb,
            group_bytes,
            data,
        }
    }

    /// A K-quant matrix: groups of [`GROUP`] whole rows, not interleaved
    /// ([`super::kquant`]'s layout).
    fn new_rows(dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Packed {
        let nb = cols / dtype.block_len();
        let row_bytes = super::kquant::row_bytes(dtype, nb);
        debug_assert_eq!(bytes.len(), rows * row_bytes);
        let group_bytes = (GROUP * row_bytes).next_multiple_of(64);
        let groups = rows.div_ceil(GROUP);
        let mut data = PackedBuf::zeroed(groups * group_bytes);
        let out: &mut [u8] = data.bytes_mut();
        for (g, src) in bytes.chunks(GROUP * row_bytes).enumerate() {
            out[g * group_bytes..g * group_bytes + src.len()].copy_from_slice(src);
        }
        Packed {
            dtype,
            rows,
            cols,
            nb,
            group_bytes,
            data,
        }
    }

    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Bytes held (the load-time copy).
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    pub fn group(&self, g: usize) -> Group<'_> {
        let all: &[u8] = self.data.bytes();
        let dst = &all[g * self.group_bytes..(g + 1) * self.group_bytes];
        if super::kquant::is_row_packed(self.dtype) {
            return Group {
                qs: dst,
                d: &dst[..0],
                m: &dst[..0],
                nb: self.nb,
                stream: all.len() >= STREAM_PREFETCH_BYTES,
            };
        }
        let qsb = qs_bytes(self.dtype);
        let nb = self.nb;
        let (qs, rest) = dst.split_at(nb * qsb);
        let (d, rest) = rest.split_at(nb * 16);
        let m = if self.dtype == DType::Q4_1 {
            &rest[..nb * 16]
        } else {
            &rest[..0]
        };
        Group {
            qs,
            d,
            m,
            nb,
            stream: all.len() >= STREAM_PREFETCH_BYTES,
        }
    }

    /// Row `r` in the file's block layout (for embedding lookups).
    pub fn row_bytes(&self, r: usize, out: &mut [u8]) {
        let g = self.group(r / GROUP);
        let k = r % GROUP;
        if super::kquant::is_row_packed(self.dtype) {
            let rb = super::kquant::row_bytes(self.dtype, self.nb);
            out.copy_from_slice(&g.qs[k * rb..(k + 1) * rb]);
            return;
        }
        let bs = self.dtype.block_bytes();
        let qsb = qs_bytes(self.dtype);
        for (b, blk) in out.chunks_exact_mut(bs).enumerate() {
            let qs = &g.qs[b * qsb..(b + 1) * qsb];
            blk[0..2].copy_from_slice(&g.d[b * 16 + k * 2..b * 16 + k * 2 + 2]);
            match self.dtype {
                DType::Q8_0 => {
                    for i in 0..QK {
                        blk[2 + i] = qs[code_pos(self.dtype, k, i)];
                    }
                }
                DType::Q4_0 | DType::IQ4_NL => {
                    for i in 0..16 {
                        blk[2 + i] = qs[code_pos(self.dtype, k, i)];
                    }
                }
                DType::Q5_0 => {
                    for half in 0..2 {
                        let at = q5_bits_pos(k, half);
                        blk[2 + 2 * half..4 + 2 * half].copy_from_slice(&qs[at..at + 2]);
                    }
                    for i in 0..16 {
                        blk[6 + i] = qs[code_pos(self.dtype, k, i)];
                    }
                }
                _ => {
                    blk[2..4].copy_from_slice(&g.m[b * 16 + k * 2..b * 16 + k * 2 + 2]);
                    for i in 0..16 {
                        blk[4 + i] = qs[code_pos(self.dtype, k, i)];
                    }
                }
            }
        }
    }
}

/// `out[k] = row (8g + k) · a` for the group's eight rows, with kernel `k` (which must
/// be supported: see [`Kernel::is_supported`]; an unsupported one runs the scalar loop).
#[inline]
pub fn dot_group(kernel: Kernel, p: &Packed, g: usize, a: &QuantizedActs, out: &mut [f32; 8]) {
    let grp = p.group(g);
    if super::kquant::is_row_packed(p.dtype) {
        return super::kquant::group(kernel, p.dtype, &grp, a, out);
    }
    debug_assert_eq!(grp.nb, a.blocks());
    // A Q5_0 (IQ4_NL) matrix reaches a variant without code for it only if packed for
    // another one.
    let kernel = if !kernel.reads(p.dtype) {
        Kernel::Scalar
    } else {
        kernel
    };
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 if kernel.is_supported() => {
            // SAFETY: AVX2, FMA and F16C were detected at run time just above (cached by
            // std); the kernel reads only inside `grp` and `a` (lengths checked by
            // debug assertions and by construction of `Packed`).
            unsafe { super::x86::group_avx2(p.dtype, &grp, a, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni if kernel.is_supported() => {
            // SAFETY: AVX-512 F/BW/VL/VNNI and F16C were detected at run time just above.
            unsafe { super::x86::group_avx512vnni(p.dtype, &grp, a, out) }
        }
        #[cfg(target_arch = "aarch64")]
        Kernel::NeonDotprod if kernel.is_supported() => {
            // SAFETY: NEON is baseline on aarch64 and `dotprod` was detected just above.
            unsafe { super::aarch64::group_neon_dotprod(p.dtype, &grp, a, out) }
        }
        Kernel::Portable => super::portable::group_portable(p.dtype, &grp, a, out),
        _ => group_scalar(p.dtype, &grp, a, out),
    }
}

/// Tokens one multi-token kernel call serves ([`dot_group_tokens`]): each weight block
/// is loaded and unpacked once for this many activation blocks.
pub const TOKENS: usize = 4;

/// `out[j][k] = row (8g + k) · acts[j]` for every token `j` (any count): the group's
/// eight rows against several tokens, [`TOKENS`] at a time, each weight block unpacked
/// once per call for all of them. Every value equals [`dot_group`]'s for that token
/// alone, bit for bit (same integer sums, same float steps in the same order), with the
/// same kernel rules (an unsupported `kernel` runs the scalar loop).
pub fn dot_group_tokens(
    kernel: Kernel,
    p: &Packed,
    g: usize,
    acts: &[&QuantizedActs],
    out: &mut [[f32; GROUP]],
) {
    debug_assert_eq!(acts.len(), out.len());
    let grp = p.group(g);
    let kernel = if !kernel.reads(p.dtype) {
        Kernel::Scalar
    } else {
        kernel
    };
    for (a, o) in acts.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
        // A short last tile repeats its last token; the extra results are dropped.
        let tile: [&QuantizedActs; TOKENS] = std::array::from_fn(|j| a[j.min(a.len() - 1)]);
        if super::kquant::is_row_packed(p.dtype) {
            let mut buf = [[0.0f32; GROUP]; TOKENS];
            super::kquant::group_tokens(kernel, p.dtype, &grp, &tile, &mut buf);
            o.copy_from_slice(&buf[..o.len()]);
            continue;
        }
        for t in &tile {
            assert_eq!(t.blocks(), grp.nb, "activation blocks vs matrix blocks");
        }
        let mut buf = [[0.0f32; GROUP]; TOKENS];
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 if kernel.is_supported() => {
                // SAFETY: AVX2, FMA and F16C were detected at run time just above; every
                // token has as many blocks as the group (asserted above).
                unsafe { super::x86::group_tokens_avx2(p.dtype, &grp, &tile, &mut buf) }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni if kernel.is_supported() => {
                // SAFETY: AVX-512 F/BW/VL/VNNI and F16C were detected just above; block
                // counts asserted above.
                unsafe { super::x86::group_tokens_avx512vnni(p.dtype, &grp, &tile, &mut buf) }
            }
            #[cfg(target_arch = "aarch64")]
            Kernel::NeonDotprod if kernel.is_supported() => {
                // SAFETY: NEON is baseline on aarch64 and `dotprod` was detected just
                // above; block counts asserted above.
                unsafe { super::aarch64::group_tokens_neon_dotprod(p.dtype, &grp, &tile, &mut buf) }
            }
            Kernel::Portable => {
                super::portable::group_tokens_portable(p.dtype, &grp, &tile, &mut buf)
            }
            _ => group_tokens_scalar(p.dtype, &grp, &tile, &mut buf),
        }
        o.copy_from_slice(&buf[..o.len()]);
    }
}

/// Tokens of one [`ActsTile`].
pub const TILE: usize = 8;

/// Up to [`TILE`] tokens' quantised activations, plus a copy interleaved by token for
/// the AVX-512 tile kernel: per block `b`, per 4-byte word `e` of the block (elements
/// `4e..4e + 4`), the tile's tokens' words side by side, so one 16-byte broadcast gives a
/// vector whose lane `(row j, token t)` holds token `t`'s word for every row `j`. Built
/// once per batched product; a short tile repeats its last token (results dropped).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct ActsTile<'a> {
    acts: Vec<&'a QuantizedActs>,
    nb: usize,
    /// `[nb][8][TILE][4]` codes.
    q: Vec<i8>,
    /// `[nb][TILE]` scales `d_x`, sums `s_x` and integer sums `Σ q_x`.
    d: Vec<f32>,
    s: Vec<f32>,
    qsum: Vec<i32>,
}

impl<'a> ActsTile<'a> {
    /// Interleaves `acts` (1 to [`TILE`] tokens, equal block counts).
    pub fn new(acts: &[&'a QuantizedActs]) -> ActsTile<'a> {
        assert!(
            !acts.is_empty() && acts.len() <= TILE,
            "1..={TILE} tokens per tile"
        );
        let nb = acts[0].blocks();
        let tok = |t: usize| acts[t.min(acts.len() - 1)];
        let mut q = vec![0i8; nb * 8 * TILE * 4];
        let (mut d, mut s, mut qsum) = (
            vec![0.0; nb * TILE],
            vec![0.0; nb * TILE],
            vec![0; nb * TILE],
        );
        for b in 0..nb {
            for t in 0..TILE {
                let a = tok(t);
                assert_eq!(a.blocks(), nb, "activation blocks differ within a tile");
                for e in 0..8 {
                    let at = ((b * 8 + e) * TILE + t) * 4;
                    q[at..at + 4].copy_from_slice(&a.q[b * QK + e * 4..b * QK + e * 4 + 4]);
                }
                d[b * TILE + t] = a.d[b];
                s[b * TILE + t] = a.s[b];
                qsum[b * TILE + t] = a.qsum[b];
            }
        }
        ActsTile {
            acts: acts.to_vec(),
            nb,
            q,
            d,
            s,
            qsum,
        }
    }

    /// Number of (real) tokens.
    pub fn len(&self) -> usize {
        self.acts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.acts.is_empty()
    }
}

/// The interleaved arrays of an [`ActsTile`], for the kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct TileView<'t> {
    pub nb: usize,
    pub q: &'t [i8],
    pub d: &'t [f32],
    pub s: &'t [f32],
    pub qsum: &'t [i32],
}

/// `out[t][k] = row (8g + k) · tile token t` for every token of the tile: as
/// [`dot_group_tokens`] (bit for bit the one-token values), with the AVX-512 VNNI
/// variant reading the tile's interleaved copy (no cross-lane reduction: each `vpdpbusd`
/// lane sums one row × one token); the other variants run [`dot_group_tokens`].
pub fn dot_group_tile(
    kernel: Kernel,
    p: &Packed,
    g: usize,
    tile: &ActsTile,
    out: &mut [[f32; GROUP]],
) {
    debug_assert_eq!(out.len(), tile.len());
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Vnni
        && kernel.is_supported()
        && kernel.reads(p.dtype)
        && !super::kquant::is_row_packed(p.dtype)
    {
        let grp = p.group(g);
        assert_eq!(grp.nb, tile.nb, "activation blocks vs matrix blocks");
        let view = TileView {
            nb: tile.nb,
            q: &tile.q,
            d: &tile.d,
            s: &tile.s,
            qsum: &tile.qsum,
        };
        let mut buf = [[0.0f32; GROUP]; TILE];
        // SAFETY: AVX-512 F/BW/VL/VNNI and F16C were detected just above; the tile has
        // the group's block count (asserted above) and its arrays are sized by `new`.
        // Four tokens or fewer: one vector per row half instead of two.
        unsafe {
            if tile.len() <= 4 {
                super::x86::group_tile_avx512vnni::<1>(p.dtype, &grp, &view, &mut buf)
            } else {
                super::x86::group_tile_avx512vnni::<2>(p.dtype, &grp, &view, &mut buf)
            }
        };
        let n = out.len();
        out.copy_from_slice(&buf[..n]);
        return;
    }
    dot_group_tokens(kernel, p, g, &tile.acts, out);
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight rows' codes of one 8-row block as signed values (Q4_0: `nibble − 8`;
/// Q5_0: `(nibble | fifth bit << 4) − 16`; IQ4_NL: the level `K[nibble]`).
#[inline(always)]
fn unpack_block(dtype: DType, qs: &[u8], w: &mut [[i8; QK]; GROUP]) {
    for (k, wk) in w.iter_mut().enumerate() {
        match dtype {
            DType::Q8_0 => {
                for (i, v) in wk.iter_mut().enumerate() {
                    *v = qs[code_pos(dtype, k, i)] as i8;
                }
            }
            DType::Q5_0 => {
                for (i, v) in wk.iter_mut().enumerate() {
                    let byte = qs[code_pos(dtype, k, i)];
                    let nib = if i < 16 { byte & 0x0F } else { byte >> 4 };
                    let at = q5_bits_pos(k, i / 16);
                    let bits = u16::from_le_bytes([qs[at], qs[at + 1]]);
                    let fifth = ((bits >> (i % 16)) & 1) as u8;
                    *v = (nib | (fifth << 4)) as i8 - 16;
                }
            }
            DType::IQ4_NL => {
                let base = code_pos(dtype, k, 0);
                let (lo, hi) = wk.split_at_mut(16);
                for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&qs[base..base + 16]) {
                    *l = IQ4_VALUES[(byte & 0x0F) as usize];
                    *h = IQ4_VALUES[(byte >> 4) as usize];
                }
            }
            _ => {
                let off = if dtype == DType::Q4_0 { 8 } else { 0 };
                let base = code_pos(dtype, k, 0);
                let (lo, hi) = wk.split_at_mut(16);
                for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&qs[base..base + 16]) {
                    *l = (byte & 0x0F) as i8 - off;
                    *h = (byte >> 4) as i8 - off;
                }
            }
        }
    }
}

/// The scalar variant: per row, per block, the reference's exact steps in plain loops.
pub fn group_scalar(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let qsb = qs_bytes(dtype);
    let mut acc = [0.0f32; GROUP];
    let mut w = [[0i8; QK]; GROUP];
    for b in 0..g.nb {
        unpack_block(dtype, &g.qs[b * qsb..(b + 1) * qsb], &mut w);
        let q: &[i8; QK] = a.q[b * QK..(b + 1) * QK].try_into().expect("one block");
        for (k, acc_k) in acc.iter_mut().enumerate() {
            let isum: i32 = w[k]
                .iter()
                .zip(q)
                .map(|(&wi, &qi)| wi as i32 * qi as i32)
                .sum();
            let dw = f16_at(g.d, b * 16 + k * 2);
            let t = isum as f32 * (dw * a.d[b]);
            *acc_k += if dtype == DType::Q4_1 {
                t + f16_at(g.m, b * 16 + k * 2) * a.s[b]
            } else {
                t
            };
        }
    }
    *out = acc;
}

/// The scalar multi-token variant: [`group_scalar`]'s steps for every token, each
/// 8-row block unpacked once for all of them (the scalar twin of the multi-token
/// kernels; equal to [`group_scalar`] per token, bit for bit).
pub fn group_tokens_scalar(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    let mut acc = [[0.0f32; GROUP]; TOKENS];
    let mut w = [[0i8; QK]; GROUP];
    for b in 0..g.nb {
        unpack_block(dtype, &g.qs[b * qsb..(b + 1) * qsb], &mut w);
        for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
            let q: &[i8; QK] = a.q[b * QK..(b + 1) * QK].try_into().expect("one block");
            for (k, acc_k) in acc_t.iter_mut().enumerate() {
                let isum: i32 = w[k]
                    .iter()
                    .zip(q)
                    .map(|(&wi, &qi)| wi as i32 * qi as i32)
                    .sum();
                let dw = f16_at(g.d, b * 16 + k * 2);
                let t = isum as f32 * (dw * a.d[b]);
                *acc_k += if dtype == DType::Q4_1 {
                    t + f16_at(g.m, b * 16 + k * 2) * a.s[b]
                } else {
                    t
                };
            }
        }
    }
    *out = acc;
}
