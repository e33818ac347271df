//! AVX-512 multi-query forms of the fused KIVI attention kernels (see the parent module
//! for the layout of codes in lanes and the single-query kernels they match bit for bit).

use super::*;

// ---------------------------------------------------------------------------------------
// Multi-query forms (grouped-query attention): the `G` query heads that share one KV head
// take each 64-byte load of codes, and each of its extracts, once. Per head the operations
// and their order are exactly those of the single-query kernels above (the same FMA
// chain per lane, the same reduction tree, the same row-set sums), so every head's result
// equals the single-query kernel's bit for bit; only the unpacking is shared.
// ---------------------------------------------------------------------------------------

/// [`vec_dot`] of two vectors of rows (at `p0`, `p1`, with `n0`, `n1` valid bytes) for
/// `G` lane-order queries: one load and one extract per code word, `G` FMAs. The two
/// vectors' chains are interleaved so that `2G` independent FMA chains are in flight (one
/// chain of a vector is [`vec_dot`]'s, whose 8–16 dependent FMAs would otherwise bound the
/// loop by the FMA latency); head `g`'s chain for each vector is exactly [`vec_dot`]'s
/// with `qv[g]`.
///
/// # Safety
/// As [`vec_dot`], for both vectors (`n = 0`: nothing is read, the vector is zero).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn vec_dot_pair_multi<const W: u8, const HD: usize, const G: usize>(
    (p0, n0): (*const u8, usize),
    (p1, n1): (*const u8, usize),
    qv: &[[__m512; 16]; G],
) -> ([__m512; G], [__m512; G]) {
    let mut acc0 = [_mm512_setzero_ps(); G];
    let mut acc1 = [_mm512_setzero_ps(); G];
    for l in 0..loads::<W, HD>() {
        // SAFETY: load l of each vector: bytes [64l, min(n, 64l + 64)) are readable.
        let (d0, d1) = unsafe {
            (
                load(p0.wrapping_add(64 * l), n0.saturating_sub(64 * l).min(64)),
                load(p1.wrapping_add(64 * l), n1.saturating_sub(64 * l).min(64)),
            )
        };
        for k in 0..per_dword::<W>() {
            let (x0, x1) = (extract::<W>(d0, k), extract::<W>(d1, k));
            let t = l * per_dword::<W>() + k;
            for ((a0, a1), q) in acc0.iter_mut().zip(acc1.iter_mut()).zip(qv) {
                *a0 = _mm512_fmadd_ps(x0, q[t], *a0);
                *a1 = _mm512_fmadd_ps(x1, q[t], *a1);
            }
        }
    }
    (acc0, acc1)
}

/// [`score_rows`] for `G` queries: head `g`'s scores of rows `[a, b)` go to
/// `out[g·stride + a..g·stride + b]`. `part` is scratch owned by the caller (a fresh
/// array per call would cost a memset of `G` KiB per K group); every block sets the
/// vectors `reduce` reads at this `rpl` (`0..16 / rpl`).
///
/// # Safety
/// AVX-512 F/BW must be available; `a ≤ b ≤ codes.len() / bpr`,
/// `(G − 1)·stride + b ≤ out.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn score_rows_multi<const W: u8, const HD: usize, const G: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[[__m512; 16]; G],
    bias: &[f32; G],
    part: &mut [[__m512; 16]; G],
    out: &mut [f32],
    stride: usize,
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    assert!(a <= b && b * bpr <= codes.len() && (G - 1) * stride + b <= out.len());
    // Vectors per block: 16 / rpl, even for every shape `takes` accepts (rpl ≤ 8).
    let nv = 16 / rpl;
    let base = codes.as_ptr();
    // The vector of rows starting at run row r: its pointer and valid bytes (none past b).
    let vector = |r: usize| {
        if r < b {
            (base.wrapping_add(r * bpr), ((b - r) * bpr).min(rpl * bpr))
        } else {
            (base, 0)
        }
    };
    let mut r0 = a;
    while r0 < b {
        // A partial block reads zero bytes past row b; those lanes are dropped.
        for v in (0..nv).step_by(2) {
            let r = r0 + v * rpl;
            if r >= b {
                for pg in part.iter_mut() {
                    pg[v] = _mm512_setzero_ps();
                    pg[v + 1] = _mm512_setzero_ps();
                }
                continue;
            }
            // SAFETY: `vector` gives bytes [r·bpr, r·bpr + n) inside `codes` (b·bpr ≤ len),
            // or n = 0.
            let (s0, s1) =
                unsafe { vec_dot_pair_multi::<W, HD, G>(vector(r), vector(r + rpl), qv) };
            for ((pg, s0), s1) in part.iter_mut().zip(s0).zip(s1) {
                pg[v] = s0;
                pg[v + 1] = s1;
            }
        }
        let m = (b - r0).min(16);
        for (g, pg) in part.iter().enumerate() {
            let s = _mm512_add_ps(reduce(pg, rpl), _mm512_set1_ps(bias[g]));
            let o = &mut out[g * stride + r0..g * stride + r0 + m];
            if m == 16 {
                // SAFETY: `o` holds 16 floats; unaligned store.
                unsafe { _mm512_storeu_ps(o.as_mut_ptr(), s) };
            } else {
                let mut buf = [0.0f32; 16];
                // SAFETY: `buf` holds 16 floats; unaligned store.
                unsafe { _mm512_storeu_ps(buf.as_mut_ptr(), s) };
                o.copy_from_slice(&buf[..m]);
            }
        }
        r0 += m;
    }
}

/// [`dot_codes_groups`] for exactly `G` queries (`q`: `(G, HD)`), each code unpacked once
/// for all of them. Head `g`'s scores equal [`dot_codes_groups`]'s bit for bit.
///
/// # Safety
/// As [`dot_codes_groups`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(in crate::kivi) unsafe fn dot_codes_groups_multi<
    const W: u8,
    const HD: usize,
    const G: usize,
>(
    run: &KRun<'_>,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let KRun {
        codes,
        scale,
        zero,
        group,
        offset,
        ..
    } = *run;
    let (bpr, e) = (bpr::<W, HD>(), per_dword::<W>());
    let nt = loads::<W, HD>() * e;
    assert!(takes(HD) && G > 0 && q.len() == G * HD && nt <= 16 && group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (G - 1) * stride + rows);
    let (idx_t, mask_t) = const { perm_tables::<W, HD>() };
    let mut idx = [_mm512_setzero_si512(); 16];
    for (t, v) in idx.iter_mut().enumerate().take(nt) {
        // SAFETY: a row of the table holds 16 i32; unaligned load.
        *v = unsafe { _mm512_loadu_si512(idx_t[t].as_ptr().cast()) };
    }
    let nv = HD / 16;
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    // Scratch declared once per call (zeroing it per group and head would be a memset).
    let mut qv = [[_mm512_setzero_ps(); 16]; G];
    let mut qs = [_mm512_setzero_ps(); 16];
    let mut part = [[_mm512_setzero_ps(); 16]; G];
    let mut bias = [0.0f32; G];
    for k in 0..groups {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(rows);
        // The fold of every head, exactly as `dot_codes_groups` does it per head.
        for (j, (qvj, bj)) in qv.iter_mut().zip(bias.iter_mut()).enumerate() {
            let mut zacc = _mm512_setzero_ps();
            for (v, qsv) in qs.iter_mut().enumerate().take(nv) {
                // SAFETY: q[j·HD + 16v..][..16] is in bounds (q.len() = G·HD); group k's
                // parameters [k·HD, (k + 1)·HD) are in bounds (assert); unaligned loads.
                let (qn, sv, zv) = unsafe {
                    (
                        _mm512_loadu_ps(q.as_ptr().add(j * HD + 16 * v)),
                        _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(k * HD + 16 * v).cast())),
                        _mm512_cvtph_ps(_mm256_loadu_si256(zp.add(k * HD + 16 * v).cast())),
                    )
                };
                *qsv = _mm512_mul_ps(qn, sv);
                zacc = _mm512_fmadd_ps(qn, zv, zacc);
            }
            for (t, x) in qvj.iter_mut().enumerate().take(nt) {
                let mut r = _mm512_setzero_ps();
                for c in 0..HD / 32 {
                    if mask_t[t][c] != 0 {
                        let y = _mm512_permutex2var_ps(qs[2 * c], idx[t], qs[2 * c + 1]);
                        r = _mm512_mask_mov_ps(r, mask_t[t][c], y);
                    }
                }
                *x = r;
            }
            *bj = _mm512_reduce_add_ps(zacc);
        }
        // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes; out ≥ (G − 1)·stride + rows.
        unsafe { score_rows_multi::<W, HD, G>(codes, (a, b), &qv, &bias, &mut part, out, stride) };
    }
}

/// Rows per super-block of [`axpy_codes_rows_multi`]: the weights `p_jr s_r` of this many
/// rows of every head are computed once into a stack buffer (`G`·1 KiB).
const SUPER: usize = 256;

/// Extracts per pass of [`axpy_codes_rows_multi`] for `G` heads: its `G × chunk`
/// accumulators stay in registers (at most 24 of the 32).
const fn chunk<const G: usize>() -> usize {
    if G <= 3 {
        8
    } else if G <= 6 {
        4
    } else {
        2
    }
}

/// `acc[j][i] += extract_{t0 + i} · wv[j]` for `i < c` and every head `j`, for the vector of
/// rows at `p` (`n` valid bytes; the rest zero): extracts `t0..t0 + c` of the vector, each
/// computed once.
///
/// # Safety
/// As [`vec_dot`]; `t0 + c ≤ loads · 32 / W`, `c ≤ 8`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn vec_axpy_chunk<const W: u8, const HD: usize, const G: usize>(
    p: *const u8,
    n: usize,
    (t0, c): (usize, usize),
    wv: &[__m512; G],
    acc: &mut [[__m512; 8]; G],
) {
    let e = per_dword::<W>();
    let mut d = _mm512_setzero_si512();
    for i in 0..c {
        let (l, k) = ((t0 + i) / e, (t0 + i) % e);
        if i == 0 || k == 0 {
            // SAFETY: load l of the vector: bytes [64l, min(n, 64l + 64)) are readable.
            d = unsafe { load(p.wrapping_add(64 * l), n.saturating_sub(64 * l).min(64)) };
        }
        let x = extract::<W>(d, k);
        for (a, w) in acc.iter_mut().zip(wv) {
            a[i] = _mm512_fmadd_ps(x, *w, a[i]);
        }
    }
}

/// [`axpy_codes_rows`] for exactly `G` queries (`p` rows `g·stride..`, `acc`: `(G, HD)`,
/// `bias`: `G`), each code extract computed once for all of them. Per super-block of rows
/// the weights of every head are computed once (as `axpy_codes_rows` does, 16 rows at a
/// time); then the extracts are taken in chunks whose accumulators for all `G` heads stay
/// in registers. Each accumulator receives exactly `axpy_codes_rows`'s FMAs in its order
/// (rows in order), so head `g`'s result equals it bit for bit.
///
/// # Safety
/// As [`axpy_codes_rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(in crate::kivi) unsafe fn axpy_codes_rows_multi<
    const W: u8,
    const HD: usize,
    const G: usize,
>(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, zero, ..
    } = *run;
    let (bpr, rpl, e) = (bpr::<W, HD>(), rpl::<W, HD>(), per_dword::<W>());
    let nt = loads::<W, HD>() * e;
    assert!(takes(HD) && G > 0 && bias.len() == G && acc.len() == G * HD && nt <= 16);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 {
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    let base = codes.as_ptr();
    let lpr = 16 / rpl;
    let nv = 16 / rpl;
    // Both powers of two, so chunks tile the extracts.
    let c = chunk::<G>().min(nt);
    // spread[v]: lane i takes the weight of row v·rpl + i / lpr of the block.
    let mut spread = [_mm512_setzero_si512(); 16];
    for (v, sv) in spread.iter_mut().enumerate().take(nv) {
        let mut idx = [0i32; 16];
        for (i, x) in idx.iter_mut().enumerate() {
            *x = ((v * rpl + i / lpr) % 16) as i32;
        }
        // SAFETY: `idx` holds 16 i32; unaligned load.
        *sv = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    }
    let mut sums = [[_mm512_setzero_ps(); 16]; G];
    let mut zsum = [_mm512_setzero_ps(); G];
    let mut wbuf = [[_mm512_setzero_ps(); SUPER / 16]; G];
    let mut s0 = 0;
    while s0 < rows {
        let blocks = (rows - s0).min(SUPER).div_ceil(16);
        for blk in 0..blocks {
            let r0 = s0 + 16 * blk;
            let m = (rows - r0).min(16);
            let mask: __mmask16 = if m == 16 { 0xFFFF } else { (1u16 << m) - 1 };
            // SAFETY: lanes < m are rows r0..r0 + m of `scale`, `zero` (in bounds);
            // masked-off lanes are not read.
            let (sv, zv) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, sp.add(r0).cast())),
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, zp.add(r0).cast())),
                )
            };
            for (j, (wj, zj)) in wbuf.iter_mut().zip(zsum.iter_mut()).enumerate() {
                // SAFETY: lanes < m are p[j·stride + r0..][..m], in bounds (assert);
                // masked-off lanes are not read.
                let pv = unsafe { _mm512_maskz_loadu_ps(mask, p.as_ptr().add(j * stride + r0)) };
                *zj = _mm512_fmadd_ps(pv, zv, *zj);
                wj[blk] = _mm512_mul_ps(pv, sv);
            }
        }
        for t0 in (0..nt).step_by(c) {
            let mut regs = [[_mm512_setzero_ps(); 8]; G];
            for (r, s) in regs.iter_mut().zip(&sums) {
                r[..c].copy_from_slice(&s[t0..t0 + c]);
            }
            for blk in 0..blocks {
                let r0 = s0 + 16 * blk;
                let m = (rows - r0).min(16);
                for (v, idx) in spread.iter().enumerate().take(nv) {
                    let r = r0 + v * rpl;
                    if r >= r0 + m {
                        break;
                    }
                    let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                    let mut wv = [_mm512_setzero_ps(); G];
                    for (x, wj) in wv.iter_mut().zip(&wbuf) {
                        *x = _mm512_permutexvar_ps(*idx, wj[blk]);
                    }
                    // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ rows);
                    // t0 + c ≤ nt, c ≤ 8.
                    unsafe {
                        vec_axpy_chunk::<W, HD, G>(base.add(r * bpr), n, (t0, c), &wv, &mut regs)
                    };
                }
            }
            for (s, r) in sums.iter_mut().zip(&regs) {
                s[t0..t0 + c].copy_from_slice(&r[..c]);
            }
        }
        s0 += blocks * 16;
    }
    // As `axpy_codes_rows`: add each head's row sets in order, then into its accumulator.
    for (j, (a, bj)) in acc.chunks_exact_mut(HD).zip(bias.iter_mut()).enumerate() {
        let mut lanes = [0.0f32; 16];
        for l in 0..loads::<W, HD>() {
            for k in 0..e {
                // SAFETY: `lanes` holds 16 floats; unaligned store.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums[j][l * e + k]) };
                for i in 0..lpr {
                    let mut t = lanes[i];
                    for s in 1..rpl {
                        t += lanes[s * lpr + i];
                    }
                    a[lane_element::<W, HD>(l, k, i)] += t;
                }
            }
        }
        *bj += _mm512_reduce_add_ps(zsum[j]);
    }
}
