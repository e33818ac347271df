//! KIVI K storage (docs/design.md §2): one `(scale, zero)` per channel and group of G
//! rows.
//!
//! ```text
//! ChannelQuant   codes[h]      (slots, packed(head_dim))      offset-binary codes
//!                scale[h]      (group_slots, head_dim) f16    one (scale, zero) per
//!                zero[h]       (group_slots, head_dim) f16    group and channel
//!                residual[h]   (R + G, head_dim) f32          rows not yet quantised,
//!                                                             ring slot b % (R + G)
//! ```
//!
//! Region row `b` belongs to group `b / G`. Group `g` is quantised at the append after
//! which `appended − R ≥ (g + 1)·G` (for R = 0: the append of its G-th row), over those
//! of its rows that are still stored after that append's eviction (the reference does
//! the same), so appending costs O(kv_dim) amortised and no row is ever re-quantised.
//! Until then its rows wait in the f32 residual ring of `R + G` rows (at most
//! `R + G − 1` rows wait at once, and a group's rows are still there when it is
//! quantised). A group's `(scale, zero)` are written once, into group slot
//! `g % (ceil(window / G) + 1)` (or `g` without a window), and stay valid for every row
//! of the group that is still stored, whatever was evicted around it. Group slots in a
//! ring assume the region evicts oldest first (at most `ceil(window / G) + 1` groups
//! have a stored row), which StreamingLLM guarantees. Writes go through the store's
//! hold journal (`journal.rs`), which saves what a held append overwrites.

use super::journal::{restore, Journal};
use super::plain::PlainRun;
use super::{clip, heads_blocks, heads_bytes, load_heads, ring_needed, slots_needed};
use super::{KeyRun, KeyStore, Region, RowStore, Shape};
use crate::error::Result;
use crate::kivi::{self, Bits, KvKernel};
use crate::state::{Reader, Writer};
use half::{f16, slice::HalfFloatSliceExt};
use std::ops::Range;

/// KIVI K rows: quantised per channel over groups of `group_size` rows.
#[derive(Debug, Clone)]
pub(crate) struct ChannelQuant {
    bits: Bits,
    head_dim: usize,
    packed: usize,
    group_size: usize,
    /// KIVI residual R
    lag: usize,
    /// group-parameter slots of the ring, or `None` to grow
    group_ring: Option<usize>,
    /// rows of the residual ring: `R + G`
    res_cap: usize,
    /// per KV head: (slots, packed); valid only for rows of quantised groups
    codes: Vec<Vec<u8>>,
    /// per KV head: (group_slots, head_dim)
    scale: Vec<Vec<f16>>,
    /// per KV head: (group_slots, head_dim)
    zero: Vec<Vec<f16>>,
    /// per KV head: (R + G, head_dim), body row `b` of a group not yet quantised in ring
    /// slot `b % (R + G)`
    residual: Vec<Vec<f32>>,
    /// hold bookkeeping, empty when not holding (`journal.rs`): fields [`CODES`],
    /// [`SCALE`], [`ZERO`], [`RESIDUAL`]
    journal: Journal,
}

/// Journal field ids of [`ChannelQuant`]'s buffers.
const CODES: u8 = 0;
const SCALE: u8 = 1;
const ZERO: u8 = 2;
const RESIDUAL: u8 = 3;

impl ChannelQuant {
    pub(crate) fn new(bits: Bits, s: Shape) -> Self {
        let (kv_heads, head_dim, group_size) = (s.kv_heads, s.head_dim, s.group_size);
        debug_assert!(group_size > 0);
        ChannelQuant {
            bits,
            head_dim,
            packed: bits.packed_len(head_dim),
            group_size,
            lag: s.residual,
            group_ring: s.capacity.map(|w| w.div_ceil(group_size) + 1),
            res_cap: group_size + s.residual,
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
            residual: vec![Vec::new(); kv_heads],
            journal: Journal::default(),
        }
    }

    #[inline]
    fn group_slot(&self, g: usize) -> usize {
        match self.group_ring {
            Some(m) => g % m,
            None => g,
        }
    }

    /// Number of quantised groups so far (the groups that have left the newest R).
    #[inline]
    fn groups_done(&self, at: &Region<'_>) -> usize {
        at.appended().saturating_sub(self.lag) / self.group_size
    }

    /// Stores region row `b` in the residual ring.
    fn write_residual(&mut self, b: usize, row: &[f32]) {
        let hd = self.head_dim;
        let r = b % self.res_cap;
        for (h, (buf, src)) in self
            .residual
            .iter_mut()
            .zip(row.chunks_exact(hd))
            .enumerate()
        {
            let dst = self.journal.write(RESIDUAL, h, buf, r * hd..(r + 1) * hd);
            dst.copy_from_slice(src);
        }
    }

    /// Quantises a complete group whose stored rows are `rows` (`(region row, slot)`, at
    /// most G rows of one group): fits `(scale, zero)` per channel over those rows,
    /// stores them at `group_slot`, and writes each row's codes at its slot.
    fn complete_group(&mut self, rows: &[(usize, usize)], group_slot: usize) {
        let (hd, p, g, cap) = (self.head_dim, self.packed, self.group_size, self.res_cap);
        debug_assert!(!rows.is_empty() && rows.len() <= g);
        debug_assert_eq!(
            rows[0].0 / g,
            rows[rows.len() - 1].0 / g,
            "rows span two groups"
        );
        let mut lo = vec![f32::INFINITY; hd];
        let mut hi = vec![f32::NEG_INFINITY; hd];
        let mut s32 = vec![0.0f32; hd];
        let mut z32 = vec![0.0f32; hd];
        for h in 0..self.residual.len() {
            lo.fill(f32::INFINITY);
            hi.fill(f32::NEG_INFINITY);
            let res = &self.residual[h];
            for &(b, _) in rows {
                let r = b % cap;
                for (c, &x) in res[r * hd..(r + 1) * hd].iter().enumerate() {
                    lo[c] = lo[c].min(x);
                    hi[c] = hi[c].max(x);
                }
            }
            let params = group_slot * hd..(group_slot + 1) * hd;
            let scale = self
                .journal
                .write(SCALE, h, &mut self.scale[h], params.clone());
            let zero = self.journal.write(ZERO, h, &mut self.zero[h], params);
            for c in 0..hd {
                let (s, z) = kivi::params(lo[c], hi[c], self.bits);
                scale[c] = s;
                zero[c] = z;
                s32[c] = s.to_f32();
                z32[c] = z.to_f32();
            }
            for &(b, slot) in rows {
                let r = b % cap;
                kivi::quantize_channels(
                    &res[r * hd..(r + 1) * hd],
                    &s32,
                    &z32,
                    self.bits,
                    self.journal
                        .write(CODES, h, &mut self.codes[h], slot * p..(slot + 1) * p),
                );
            }
        }
    }

    /// f32 copies of a group's parameters for KV head `h` (`head_dim` values each).
    #[inline]
    fn load_params(&self, h: usize, group_slot: usize, scale: &mut [f32], zero: &mut [f32]) {
        let hd = self.head_dim;
        self.scale[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(scale);
        self.zero[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(zero);
    }

    /// Dequantises a row of a complete group, given its group's f32 parameters.
    #[inline]
    fn read_quant(&self, h: usize, slot: usize, scale: &[f32], zero: &[f32], out: &mut [f32]) {
        let p = self.packed;
        kivi::dequantize_channels(
            &self.codes[h][slot * p..(slot + 1) * p],
            scale,
            zero,
            self.bits,
            out,
        );
    }

    /// Reads body row `b` of a group not yet quantised.
    #[inline]
    fn read_residual(&self, h: usize, b: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        let r = b % self.res_cap;
        out.copy_from_slice(&self.residual[h][r * hd..(r + 1) * hd]);
    }

    /// A view of the quantised rows in slots `slots` of KV head `h`: complete groups in
    /// consecutive group slots from `group_slot` on, the first row being row `offset` of
    /// its group (earlier rows of that group may have been evicted).
    #[inline]
    fn run(
        &self,
        h: usize,
        slots: Range<usize>,
        group_slot: usize,
        offset: usize,
    ) -> ChannelRun<'_> {
        let (hd, p, g) = (self.head_dim, self.packed, self.group_size);
        let groups = (offset + slots.len()).div_ceil(g);
        let params = group_slot * hd..(group_slot + groups) * hd;
        ChannelRun {
            bits: self.bits,
            hd,
            packed: p,
            group: g,
            offset,
            codes: &self.codes[h][slots.start * p..slots.end * p],
            scale: &self.scale[h][params.clone()],
            zero: &self.zero[h][params],
        }
    }

    /// A view of body rows `b` (of groups not yet quantised) of KV head `h`.
    #[inline]
    fn residual_run(&self, h: usize, b: Range<usize>) -> PlainRun<'_, f32> {
        let (hd, cap) = (self.head_dim, self.res_cap);
        let r0 = b.start % cap;
        debug_assert!(r0 + b.len() <= cap, "residual run crosses the ring's wrap");
        PlainRun::new(hd, &self.residual[h][r0 * hd..(r0 + b.len()) * hd])
    }

    /// Bytes of one quantised row's codes across all heads.
    fn code_row_bytes(&self) -> usize {
        self.codes.len() * self.packed
    }
    /// Bytes of one residual row across all heads.
    fn residual_row_bytes(&self) -> usize {
        self.residual.len() * self.head_dim * std::mem::size_of::<f32>()
    }
    /// Bytes of one group's parameters across all heads: scale + zero per channel.
    fn group_bytes(&self) -> usize {
        self.scale.len() * self.head_dim * 2 * std::mem::size_of::<f16>()
    }
}

impl RowStore for ChannelQuant {
    fn append(&mut self, b: usize, slot: Option<usize>, row: &[f32], at: &Region<'_>) {
        self.journal.mark();
        let g = self.group_size;
        if slot.is_some() {
            self.write_residual(b, row);
        }
        // The row that has just left the newest R; if it completes its group, quantise
        // the group's stored rows once.
        let Some(lb) = b.checked_sub(self.lag) else {
            return;
        };
        if !(lb + 1).is_multiple_of(g) {
            return;
        }
        let rows: Vec<(usize, usize)> = (lb + 1 - g..lb + 1)
            .filter(|&r| at.is_stored(r))
            .map(|r| (r, at.slot(r)))
            .collect();
        if !rows.is_empty() {
            self.complete_group(&rows, self.group_slot(lb / g));
        }
    }

    fn read(&self, h: usize, b: usize, at: &Region<'_>, out: &mut [f32]) {
        let g = b / self.group_size;
        if g < self.groups_done(at) {
            let hd = self.head_dim;
            let mut params = vec![0.0; 2 * hd];
            let (s, z) = params.split_at_mut(hd);
            self.load_params(h, self.group_slot(g), s, z);
            self.read_quant(h, at.slot(b), s, z, out)
        } else {
            self.read_residual(h, b, out)
        }
    }

    /// Quantised groups share a run while their parameter slots are consecutive (no
    /// group ring), so a 16K-row dense step costs a handful of runs instead of 512 per
    /// head; under a group ring a run breaks at every group border. The residual breaks
    /// at its ring's wrap.
    fn run_end(&self, b: usize, end: usize, at: &Region<'_>) -> usize {
        let (g, done) = (self.group_size, self.groups_done(at));
        if b / g < done {
            if self.group_ring.is_none() {
                end.min(done * g)
            } else {
                end.min((b / g + 1) * g)
            }
        } else {
            end.min((b / self.res_cap + 1) * self.res_cap)
        }
    }

    fn hold(&mut self) {
        self.journal.hold();
    }

    fn stop_holding(&mut self) {
        self.journal.stop();
    }

    fn rewind(&mut self, keep: usize) {
        let (codes, scale, zero, residual) = (
            &mut self.codes,
            &mut self.scale,
            &mut self.zero,
            &mut self.residual,
        );
        self.journal
            .rewind(keep, |field, h, at, old, len| match field {
                CODES => restore(&mut codes[h], at, old, len),
                SCALE => restore(&mut scale[h], at, old, len),
                ZERO => restore(&mut zero[h], at, old, len),
                _ => restore(&mut residual[h], at, old, len),
            });
    }

    fn hold_bytes(&self) -> usize {
        self.journal.bytes()
    }

    fn bytes(&self, at: &Region<'_>) -> usize {
        let g = self.group_size;
        let done = self.groups_done(at);
        let rows = at.stored();
        let residual_rows = at.stored_in(done * g, at.appended());
        let quant_rows = rows - residual_rows;
        // Complete groups that still have a stored row.
        let live_groups = done.saturating_sub(at.first_stored() / g);
        quant_rows * self.code_row_bytes()
            + residual_rows * self.residual_row_bytes()
            + live_groups * self.group_bytes()
    }

    fn buffer_bytes(&self) -> usize {
        heads_bytes(&self.codes)
            + heads_bytes(&self.scale)
            + heads_bytes(&self.zero)
            + heads_bytes(&self.residual)
    }

    fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        heads_blocks(&self.codes, f);
        heads_blocks(&self.scale, f);
        heads_blocks(&self.zero, f);
        heads_blocks(&self.residual, f);
        self.journal.copy_blocks(f);
    }

    fn save(&self, w: &mut Writer) {
        self.codes.iter().for_each(|v| w.vec(v));
        self.scale.iter().for_each(|v| w.vec(v));
        self.zero.iter().for_each(|v| w.vec(v));
        self.residual.iter().for_each(|v| w.vec(v));
    }

    /// Stored rows of complete groups need their codes' slots and their groups'
    /// parameter slots (all of them up to the last complete group without a group ring:
    /// a run spans groups); the others, their residual ring slots.
    fn load(
        &mut self,
        r: &mut Reader<'_>,
        at: &Region<'_>,
        stored: &[Range<usize>],
        what: &str,
    ) -> Result<()> {
        let (g, hd, heads, n) = (
            self.group_size,
            self.head_dim,
            self.codes.len(),
            at.appended(),
        );
        let done = self.groups_done(at);
        let quant = clip(stored, 0, done * g);
        let waiting = clip(stored, done * g, usize::MAX);
        let groups: Vec<Range<usize>> = quant
            .iter()
            .map(|q| q.start / g..(q.end - 1) / g + 1)
            .collect();
        let (need_groups, max_groups) = match self.group_ring {
            Some(m) => (ring_needed(&groups, m), m.min(done)),
            None => (groups.iter().map(|x| x.end).max().unwrap_or(0), done),
        };
        let need_codes = slots_needed(at, &quant);
        let packed = self.packed;
        self.codes = load_heads(r, heads, packed, need_codes, n, &|| format!("{what} codes"))?;
        let params = |name: &str| format!("{what} {name}s");
        self.scale = load_heads(r, heads, hd, need_groups, max_groups, &|| params("scale"))?;
        self.zero = load_heads(r, heads, hd, need_groups, max_groups, &|| params("zero"))?;
        let need_res = ring_needed(&waiting, self.res_cap);
        let max_res = self.res_cap.min(n);
        self.residual = load_heads(r, heads, hd, need_res, max_res, &|| {
            format!("{what} residual")
        })?;
        Ok(())
    }
}

impl KeyStore for ChannelQuant {
    fn clone_box(&self) -> Box<dyn KeyStore> {
        Box::new(self.clone())
    }
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn KeyRun),
    ) {
        let g = self.group_size;
        let b = rows.start;
        if b / g < self.groups_done(at) {
            let s = at.slot(b);
            f(&self.run(h, s..s + rows.len(), self.group_slot(b / g), b % g))
        } else {
            f(&self.residual_run(h, rows))
        }
    }
}

/// Consecutive quantised K rows of one KV head, all of one group (one `(scale, zero)`
/// per channel).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChannelRun<'a> {
    bits: Bits,
    hd: usize,
    packed: usize,
    /// rows per group
    group: usize,
    /// row of the first group at which the run starts
    offset: usize,
    /// (len, packed)
    codes: &'a [u8],
    /// (groups, head_dim)
    scale: &'a [f16],
    /// (groups, head_dim)
    zero: &'a [f16],
}

impl ChannelRun<'_> {
    /// The run cut at group boundaries: `(k, rows)` for its `k`-th group, `rows` the
    /// run-relative row range in it.
    fn segments(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        let (g, off, n) = (self.group, self.offset, self.len());
        (0..(off + n).div_ceil(g)).map(move |k| {
            let a = (k * g).saturating_sub(off);
            let b = ((k + 1) * g - off).min(n);
            (k, a..b)
        })
    }
}

impl KeyRun for ChannelRun<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.codes.len() / self.packed
    }

    /// Scores `out[j * stride + r] = q_j · k_r`: per group, its scales folded into the
    /// queries once (`fold`: `(queries, head_dim)` scratch), then one code dot product
    /// per row and query: `q·k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`, each row's codes
    /// unpacked once for all the queries (grouped-query attention). A row's score does not
    /// depend on how many groups the run spans, nor on how many queries share the call.
    fn dot_rows(
        &self,
        kernel: KvKernel,
        qs: &[f32],
        fold: &mut [f32],
        out: &mut [f32],
        stride: usize,
    ) {
        kivi::dot_codes_groups_multi_with(
            kernel,
            &kivi::KRun {
                codes: self.codes,
                hd: self.hd,
                scale: self.scale,
                zero: self.zero,
                group: self.group,
                offset: self.offset,
                bits: self.bits,
            },
            qs,
            fold,
            out,
            stride,
        );
    }

    /// Calls `f(r0, rows)` with the rows dequantised into `buf` (exactly what `read_key`
    /// returns), a block of up to `buf.len() / head_dim` rows of one group at a time
    /// (`rows`: `(m, head_dim)`, run rows `r0..r0 + m`). `params` is `2 * head_dim`
    /// scratch.
    fn for_each_block(
        &self,
        buf: &mut [f32],
        params: &mut [f32],
        f: &mut dyn FnMut(usize, &mut [f32]),
    ) {
        let (hd, p) = (self.hd, self.packed);
        let block = buf.len() / hd;
        debug_assert!(block > 0);
        let (s, z) = params[..2 * hd].split_at_mut(hd);
        for (k, rows) in self.segments() {
            self.scale[k * hd..(k + 1) * hd].convert_to_f32_slice(s);
            self.zero[k * hd..(k + 1) * hd].convert_to_f32_slice(z);
            let codes = &self.codes[rows.start * p..rows.end * p];
            for (b, codes) in codes.chunks(block * p).enumerate() {
                let m = codes.len() / p;
                let out = &mut buf[..m * hd];
                for (row, c) in out.chunks_exact_mut(hd).zip(codes.chunks_exact(p)) {
                    kivi::dequantize_channels_simd(c, s, z, self.bits, row);
                }
                f(rows.start + b * block, out);
            }
        }
    }
}
