//! How a quantised matrix is held for the kernels ([`Packed`]): repacked once at load into
//! groups of [`GROUP`] rows, in one of the two layouts of the type table
//! ([`super::Layout`]).
//!
//! # Interleaved: eight rows per block of 32 (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL)
//!
//! Within a group, block `b` of the eight rows is stored together, so one activation block
//! meets eight weight rows and the eight per-block integer sums are reduced together into
//! one vector whose lane `k` is row `k` (one row's float chain per lane: the reference's
//! order). Per group:
//!
//! * `qs`: `nb` 8-row blocks of codes, 128 bytes (Q4_0/Q4_1/IQ4_NL), 160 bytes (Q5_0: the 128
//!   bytes of nibbles, then 32 bytes of fifth bits) or 256 bytes (Q8_0) each ([`qs_bytes`]);
//! * `d`: `nb × 8` f16 scales (16 bytes per block);
//! * `m`: `nb × 8` f16 minimums (Q4_1 only);
//!
//! padded to a 64-byte boundary. Inside an 8-row block of codes, rows 0–3 come first,
//! then rows 4–7, so a 64-byte vector holds four rows:
//!
//! * Q4 (and IQ4_NL): bytes `[(r / 4)·64 + (r % 4)·16 ..][..16]` are row `r`'s 16 nibble
//!   bytes as in the file (element `i < 16` in the low nibble of byte `i`, element `i + 16`
//!   in its high nibble; IQ4_NL's nibble `n` stands for the level `K[n]`,
//!   [`super::blocks::IQ4_VALUES`]);
//! * Q8: byte `(r / 4)·128 + (i / 16)·64 + (r % 4)·16 + i % 16` is row `r`'s element `i`;
//! * Q5_0: the nibbles as Q4's; then, at `128 + (r / 4)·16 + (i / 16)·8 + (r % 4)·2`, the
//!   little-endian `u16` whose bit `i % 16` is the fifth bit of row `r`'s element `i` (the
//!   low or high half of the block's `qh`). So each 8 bytes are the four fifth-bit masks of
//!   one 64-byte nibble vector (rows 0–3 or 4–7, elements 0..16 or 16..32), in its row
//!   order: one 64-bit mask for AVX-512 (`k` register), one 32-bit word per row pair for
//!   AVX2.
//!
//! # Rows: eight whole rows (Q5_1, the K-quants, IQ4_XS)
//!
//! Each group is its eight rows' (super-)blocks exactly as in the file, one row after
//! another (each row `cols / block_len · block_bytes` long, [`row_bytes`]), padded to 64
//! bytes. A 144- or 210-byte super-block already fills several vectors, so the kernels walk
//! a row's blocks in place.

use super::{Layout, GROUP, QK};
use crate::dtype::DType;

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
#[inline]
pub(crate) fn qs_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q8_0 => 256,
        DType::Q5_0 => 160,
        DType::Q4_0 | DType::Q4_1 | DType::IQ4_NL => 128,
        rows_or_float!() => unreachable!("{dtype} is not interleaved"),
    }
}

/// Position of row `r`'s element `i` (Q8_0) or of the byte holding its nibble (Q4, Q5_0:
/// element `i` and `i + 16` share a byte) inside an 8-row block of codes.
#[inline(always)]
pub(crate) fn code_pos(dtype: DType, r: usize, i: usize) -> usize {
    match dtype {
        DType::Q8_0 => (r / 4) * 128 + (i / 16) * 64 + (r % 4) * 16 + i % 16,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::IQ4_NL => {
            (r / 4) * 64 + (r % 4) * 16 + i % 16
        }
        rows_or_float!() => unreachable!("{dtype} is not interleaved"),
    }
}

/// Position of the `u16` of row `r`'s fifth bits of elements `16·half..16·half + 16`
/// inside a Q5_0 8-row block of codes.
#[inline(always)]
pub(crate) fn q5_bits_pos(r: usize, half: usize) -> usize {
    128 + (r / 4) * 16 + half * 8 + (r % 4) * 2
}

/// A GGML-block matrix repacked into groups of [`GROUP`] rows (module docs).
pub struct Packed {
    /// The type of the blocks (the file's).
    pub dtype: DType,
    /// The type's layout ([`super::entry`]), kept so that [`Packed::group`] asks no table.
    layout: Layout,
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
    /// AVX2 multi-token kernel prefetches ahead in it (the AVX2 one-token kernel does in
    /// every matrix, the AVX-512 one-token kernel one group ahead in every matrix).
    pub stream: bool,
}

/// Packed matrices of at least this many bytes do not stay in a last-level cache between
/// tokens ([`Group::stream`]; benches/README.md, "Q4_1 out of DRAM").
pub const STREAM_PREFETCH_BYTES: usize = 64 << 20;

impl Packed {
    /// Repacks row-major GGML rows (`rows × cols`, validated lengths) into the layout of
    /// `dtype` ([`super::entry`]; every kernel variant reads the same packing). Rows past
    /// the end of the last group are zero (scale 0) and their results are never read.
    ///
    /// # Panics
    /// If `dtype` is a float type (float matrices are read in place, not packed).
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Packed {
        Packed::new_releasing(dtype, rows, cols, bytes, &|_| {})
    }

    /// [`Packed::new`], calling `release(range)` once each stretch of `bytes[range]` has
    /// been copied (whole groups of rows, [`RELEASE_GROUPS`] at a time; every byte in
    /// exactly one range), so a caller can return a mapped file's pages while the copy
    /// grows ([`crate::weights::TensorBytes::release`]): the two are never both resident
    /// in full. Stretches are repacked in parallel on the current rayon pool; the result
    /// does not depend on the order.
    pub fn new_releasing(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        release: &(dyn Fn(std::ops::Range<usize>) + Sync),
    ) -> Packed {
        use rayon::prelude::*;
        let layout = super::entry(dtype).layout;
        let nb = cols / dtype.block_len();
        let row_bytes = row_bytes(dtype, nb);
        debug_assert_eq!(bytes.len(), rows * row_bytes);
        let group_bytes = match layout {
            Layout::Rows => (GROUP * row_bytes).next_multiple_of(64),
            Layout::Interleaved => {
                let mins = if dtype == DType::Q4_1 { 16 } else { 0 };
                (nb * (qs_bytes(dtype) + 16 + mins)).next_multiple_of(64)
            }
            Layout::Float => panic!("{dtype} matrices are not packed"),
        };
        let groups = rows.div_ceil(GROUP);
        let mut data = PackedBuf::zeroed(groups * group_bytes);
        let stretch = RELEASE_GROUPS * GROUP * row_bytes;
        data.bytes_mut()[..groups * group_bytes]
            .par_chunks_mut(RELEASE_GROUPS * group_bytes)
            .zip(bytes.par_chunks(stretch))
            .enumerate()
            .for_each(|(i, (out, src))| {
                for (dst, rows) in out
                    .chunks_mut(group_bytes)
                    .zip(src.chunks(GROUP * row_bytes))
                {
                    match layout {
                        Layout::Rows => dst[..rows.len()].copy_from_slice(rows),
                        _ => interleave_group(dtype, nb, rows, row_bytes, dst),
                    }
                }
                release(i * stretch..i * stretch + src.len());
            });
        Packed {
            dtype,
            layout,
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
        if self.layout == Layout::Rows {
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
        if self.layout == Layout::Rows {
            let rb = row_bytes(self.dtype, self.nb);
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
                DType::Q4_1 => {
                    blk[2..4].copy_from_slice(&g.m[b * 16 + k * 2..b * 16 + k * 2 + 2]);
                    for i in 0..16 {
                        blk[4 + i] = qs[code_pos(self.dtype, k, i)];
                    }
                }
                rows_or_float!() => unreachable!("{} is not interleaved", self.dtype),
            }
        }
    }
}

/// Groups a [`Packed::new_releasing`] stretch holds: 2,048 rows, 1–2 MiB of the files'
/// matrices (a page run worth returning at once, and work enough per rayon task).
pub const RELEASE_GROUPS: usize = 256;

/// Interleaves the (up to [`GROUP`]) rows `rows` (`row_bytes` each, `nb` blocks) into one
/// group `dst` of the interleaved layout (module docs); rows past the last stay zero.
fn interleave_group(dtype: DType, nb: usize, rows: &[u8], row_bytes: usize, dst: &mut [u8]) {
    let bs = dtype.block_bytes();
    let qsb = qs_bytes(dtype);
    let mins = dtype == DType::Q4_1;
    for (k, row) in rows.chunks_exact(row_bytes).enumerate() {
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
                DType::Q4_0 | DType::Q4_1 | DType::IQ4_NL => {
                    let off = if mins { 4 } else { 2 };
                    for i in 0..16 {
                        qs[code_pos(dtype, k, i)] = blk[off + i];
                    }
                }
                rows_or_float!() => unreachable!("{dtype} is not interleaved"),
            }
            let d_at = nb * qsb + b * 16 + k * 2;
            dst[d_at..d_at + 2].copy_from_slice(&blk[0..2]);
            if mins {
                let m_at = nb * qsb + nb * 16 + b * 16 + k * 2;
                dst[m_at..m_at + 2].copy_from_slice(&blk[2..4]);
            }
        }
    }
}

/// Bytes of one row of `nb` (super-)blocks of `dtype`, as in the file.
pub fn row_bytes(dtype: DType, nb: usize) -> usize {
    nb * dtype.block_bytes()
}
