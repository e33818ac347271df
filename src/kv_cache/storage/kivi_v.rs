//! KIVI V storage (docs/design.md §2): one `(scale, zero)` per token and KV head.
//!
//! ```text
//! TokenQuant     codes[h]      (slots, packed(head_dim))      offset-binary codes
//!                scale[h]      (slots)  f16                   one (scale, zero) per
//!                zero[h]       (slots)  f16                   token and KV head
//!                residual      Rows<f32>, min(R, window) slots, ring slot b % that
//! ```
//!
//! A row is quantised when it leaves the newest R rows (at append for R = 0); until then
//! it waits in the f32 residual ring and is quantised from there, into its own slot,
//! just before its ring slot is reused (if it is still stored). Writes (the residual
//! ring's too) go through the store's hold journal (`journal.rs`).

use super::journal::{restore, Journal};
use super::plain::{PlainRun, Rows};
use super::{clip, heads_blocks, heads_bytes, load_heads, ring_needed, slots_needed};
use super::{Region, RowStore, Shape, ValueRun, ValueStore};
use crate::error::Result;
use crate::kivi::{self, Bits, KvKernel};
use crate::state::{Reader, Writer};
use half::f16;
use std::ops::Range;

/// KIVI V rows: quantised per token and KV head when they leave the residual (at
/// append for R = 0).
#[derive(Debug, Clone)]
pub(crate) struct TokenQuant {
    bits: Bits,
    /// KIVI residual R
    residual: usize,
    /// rows of the residual ring (`min(R, window)`), when R > 0
    res_cap: usize,
    /// the f32 residual ring, when R > 0
    res: Option<Rows<f32>>,
    head_dim: usize,
    /// packed bytes of one head's row
    packed: usize,
    /// per KV head: (slots, packed)
    codes: Vec<Vec<u8>>,
    /// per KV head: (slots)
    scale: Vec<Vec<f16>>,
    /// per KV head: (slots)
    zero: Vec<Vec<f16>>,
    /// hold bookkeeping, empty when not holding (`journal.rs`): fields [`CODES`],
    /// [`SCALE`], [`ZERO`], [`RESIDUAL`] (the ring `res`, journaled here)
    journal: Journal,
}

/// Journal field ids of [`TokenQuant`]'s buffers.
const CODES: u8 = 0;
const SCALE: u8 = 1;
const ZERO: u8 = 2;
const RESIDUAL: u8 = 3;

impl TokenQuant {
    pub(crate) fn new(bits: Bits, s: Shape) -> Self {
        let (kv_heads, head_dim) = (s.kv_heads, s.head_dim);
        let res_cap = s.capacity.map_or(s.residual, |w| s.residual.min(w));
        TokenQuant {
            bits,
            residual: s.residual,
            res_cap,
            res: (res_cap > 0).then(|| Rows::new(kv_heads, head_dim)),
            head_dim,
            packed: bits.packed_len(head_dim),
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
            journal: Journal::default(),
        }
    }

    fn write(&mut self, slot: usize, row: &[f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(row.len(), self.codes.len() * hd);
        for (h, src) in row.chunks_exact(hd).enumerate() {
            self.write_head(h, slot, src);
        }
    }

    /// Quantises KV head `h`'s slice of a row (`head_dim` values) into `slot`.
    fn write_head(&mut self, h: usize, slot: usize, src: &[f32]) {
        let (p, j) = (self.packed, &mut self.journal);
        let codes = j.write(CODES, h, &mut self.codes[h], slot * p..(slot + 1) * p);
        let (s, z) = kivi::quantize_token(src, self.bits, codes);
        j.write(SCALE, h, &mut self.scale[h], slot..slot + 1)[0] = s;
        j.write(ZERO, h, &mut self.zero[h], slot..slot + 1)[0] = z;
    }

    #[inline]
    fn read_slot(&self, h: usize, slot: usize, out: &mut [f32]) {
        let p = self.packed;
        kivi::dequantize_token(
            &self.codes[h][slot * p..(slot + 1) * p],
            self.scale[h][slot],
            self.zero[h][slot],
            self.bits,
            out,
        );
    }

    /// Region rows that have left the newest R (`max(0, appended − R)`): rows below are
    /// quantised.
    #[inline]
    fn left(&self, at: &Region<'_>) -> usize {
        at.appended().saturating_sub(self.residual)
    }

    /// Bytes one stored row occupies across all heads: codes + scale + zero.
    fn row_bytes(&self) -> usize {
        self.codes.len() * (self.packed + 2 * std::mem::size_of::<f16>())
    }

    /// A view of slots `slots` of KV head `h`.
    #[inline]
    fn run(&self, h: usize, slots: Range<usize>) -> TokenRun<'_> {
        let p = self.packed;
        TokenRun {
            bits: self.bits,
            hd: self.head_dim,
            packed: p,
            codes: &self.codes[h][slots.start * p..slots.end * p],
            scale: &self.scale[h][slots.clone()],
            zero: &self.zero[h][slots],
        }
    }
}

/// Consecutive KIVI V rows of one KV head, each with its own `(scale, zero)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenRun<'a> {
    bits: Bits,
    hd: usize,
    packed: usize,
    /// (len, packed)
    codes: &'a [u8],
    /// (len)
    scale: &'a [f16],
    /// (len)
    zero: &'a [f16],
}

impl ValueRun for TokenRun<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.scale.len()
    }

    #[cfg(test)]
    fn read(&self, r: usize, out: &mut [f32]) {
        let p = self.packed;
        kivi::dequantize_token(
            &self.codes[r * p..(r + 1) * p],
            self.scale[r],
            self.zero[r],
            self.bits,
            out,
        );
    }

    /// `acc_j += Σ_r p_jr · v_r` for every query `j`, with `v_r = u_r·s_r + z_r` folded:
    /// the codes are accumulated with weight `p_jr·s_r` and `Σ_r p_jr·z_r` is added to
    /// `bias[j]` (the caller adds `bias[j]` to every element of `acc_j` at the end). Each
    /// row's codes are unpacked once for all the queries (grouped-query attention); a
    /// query's result does not depend on how many share the call.
    fn axpy_rows(
        &self,
        kernel: KvKernel,
        p: &[f32],
        stride: usize,
        acc: &mut [f32],
        bias: &mut [f32],
    ) {
        debug_assert_eq!(acc.len(), bias.len() * self.hd);
        debug_assert_eq!(self.codes.len(), self.len() * self.packed);
        kivi::axpy_codes_rows_multi_with(
            kernel,
            &kivi::VRun {
                codes: self.codes,
                scale: self.scale,
                zero: self.zero,
                bits: self.bits,
            },
            p,
            stride,
            acc,
            bias,
        );
    }
}

impl RowStore for TokenQuant {
    fn append(&mut self, b: usize, slot: Option<usize>, row: &[f32], at: &Region<'_>) {
        self.journal.mark();
        let Some(mut res) = self.res.take() else {
            if let Some(slot) = slot {
                self.write(slot, row);
            }
            return;
        };
        let (hd, cap) = (self.head_dim, self.res_cap);
        // Quantise the row leaving the newest R (if still stored) before its ring slot is
        // reused.
        if let Some(lb) = b.checked_sub(self.residual).filter(|&lb| at.is_stored(lb)) {
            let mut buf = [0.0f32; 256];
            let mut heap = Vec::new();
            let tmp: &mut [f32] = if hd <= buf.len() {
                &mut buf[..hd]
            } else {
                heap.resize(hd, 0.0);
                &mut heap
            };
            let to = at.slot(lb);
            for h in 0..self.codes.len() {
                res.read_slot(h, lb % cap, tmp);
                self.write_head(h, to, tmp);
            }
        }
        if slot.is_some() {
            res.write_in(&mut self.journal, RESIDUAL, b % cap, row);
        }
        self.res = Some(res);
    }

    fn hold(&mut self) {
        self.journal.hold();
    }

    fn stop_holding(&mut self) {
        self.journal.stop();
    }

    fn rewind(&mut self, keep: usize) {
        let (codes, scale, zero, res) = (
            &mut self.codes,
            &mut self.scale,
            &mut self.zero,
            &mut self.res,
        );
        self.journal
            .rewind(keep, |field, h, at, old, len| match field {
                CODES => restore(&mut codes[h], at, old, len),
                SCALE => restore(&mut scale[h], at, old, len),
                ZERO => restore(&mut zero[h], at, old, len),
                // RESIDUAL: journaled only by a store with a ring.
                _ => {
                    if let Some(res) = res.as_mut() {
                        res.restore(h, at, old, len)
                    }
                }
            });
    }

    fn hold_bytes(&self) -> usize {
        self.journal.bytes()
    }

    fn read(&self, h: usize, b: usize, at: &Region<'_>, out: &mut [f32]) {
        match &self.res {
            Some(res) if b >= self.left(at) => res.read_slot(h, b % self.res_cap, out),
            _ => self.read_slot(h, at.slot(b), out),
        }
    }

    /// Breaks where the residual starts and at its ring's wrap.
    fn run_end(&self, b: usize, end: usize, at: &Region<'_>) -> usize {
        if self.res.is_none() {
            return end;
        }
        let (left, cap) = (self.left(at), self.res_cap);
        if b < left {
            end.min(left)
        } else {
            end.min((b / cap + 1) * cap)
        }
    }

    fn bytes(&self, at: &Region<'_>) -> usize {
        let rows = at.stored();
        // Rows still in the residual are f32.
        let (res_rows, res_row_bytes) = match &self.res {
            Some(r) => (at.stored_in(self.left(at), at.appended()), r.row_bytes()),
            None => (0, 0),
        };
        (rows - res_rows) * self.row_bytes() + res_rows * res_row_bytes
    }

    fn buffer_bytes(&self) -> usize {
        heads_bytes(&self.codes)
            + heads_bytes(&self.scale)
            + heads_bytes(&self.zero)
            + self.res.as_ref().map_or(0, RowStore::buffer_bytes)
    }

    fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        heads_blocks(&self.codes, f);
        heads_blocks(&self.scale, f);
        heads_blocks(&self.zero, f);
        if let Some(res) = &self.res {
            res.copy_blocks(f);
        }
        self.journal.copy_blocks(f);
    }

    fn save(&self, w: &mut Writer) {
        self.codes.iter().for_each(|v| w.vec(v));
        self.scale.iter().for_each(|v| w.vec(v));
        self.zero.iter().for_each(|v| w.vec(v));
        if let Some(res) = &self.res {
            res.save_rows(w);
        }
    }

    /// Stored rows that have left the residual need their slots' codes and parameters;
    /// the others, their residual ring slots.
    fn load(
        &mut self,
        r: &mut Reader<'_>,
        at: &Region<'_>,
        stored: &[Range<usize>],
        what: &str,
    ) -> Result<()> {
        let (heads, n) = (self.codes.len(), at.appended());
        let left = match self.res {
            Some(_) => self.left(at),
            None => usize::MAX,
        };
        let quant = clip(stored, 0, left);
        let need = slots_needed(at, &quant);
        let p = self.packed;
        self.codes = load_heads(r, heads, p, need, n, &|| format!("{what} codes"))?;
        self.scale = load_heads(r, heads, 1, need, n, &|| format!("{what} scales"))?;
        self.zero = load_heads(r, heads, 1, need, n, &|| format!("{what} zeros"))?;
        if let Some(res) = &mut self.res {
            let waiting = clip(stored, left, usize::MAX);
            let cap = self.res_cap;
            res.load_rows(r, ring_needed(&waiting, cap), cap.min(n), &|| {
                format!("{what} residual")
            })?;
        }
        Ok(())
    }
}

impl ValueStore for TokenQuant {
    fn clone_box(&self) -> Box<dyn ValueStore> {
        Box::new(self.clone())
    }
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn ValueRun),
    ) {
        match &self.res {
            Some(res) if rows.start >= self.left(at) => {
                let r0 = rows.start % self.res_cap;
                let run: PlainRun<'_, f32> = res.run(h, r0..r0 + rows.len());
                f(&run)
            }
            _ => {
                let s = at.slot(rows.start);
                f(&self.run(h, s..s + rows.len()))
            }
        }
    }
}
