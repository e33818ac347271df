//! Weight kernels: the products of a weight matrix, held in its file type, with an
//! activation vector; one table of the weight types; the kernels laid out by instruction
//! set, as ggml-cpu lays out its own (`arch/x86`, `arch/arm`, its generic code). The KV
//! cache's kernels, over KIVI codes, are elsewhere (`src/kivi`, `src/quant`).
//!
//! # The table ([`entry`])
//!
//! One row per weight type ([`DType`]; block length and bytes are the type's own,
//! `tinygpt_types::ggml`):
//!
//! | type                          | reads ([`Acts`]) | held as ([`Layout`]) | dequantiser |
//! |-------------------------------|------------------|----------------------|-------------|
//! | F32, F16, BF16                | f32              | float rows, in place | `dequant`   |
//! | Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL| 8-bit blocks of 32 | 8 rows interleaved | `dequant`   |
//! | Q5_1                          | 8-bit blocks of 32 | 8 whole rows       | `dequant`   |
//! | Q2_K … Q6_K, IQ4_XS           | Q8_K             | 8 whole rows         | `dequant`   |
//!
//! and, per type, the kernels each [`Kernel`] variant runs for it, resolved once per matrix
//! when it is loaded ([`Kernels::new`], held by [`crate::ops::Matrix`]): a product calls
//! them through function pointers, with no dispatch on type or variant per call (inside,
//! an interleaved kernel's `per_code_type!` jumps to its loop's copy for the type). Every
//! `match` on [`DType`] here lists every type (no wildcard arm), so a new type makes the
//! compiler name each place it must fill (docs/contributing.md).
//!
//! # Numerics
//!
//! Every variant of every type equals its scalar twin ([`scalar`]) bit for bit, and the
//! scalar twins equal the reference's (`tinygpt_reference::ggml_dot`, `ggml_kdot`; the
//! float order: [`float`]): per block (or super-block) the integer sums are exact, and
//! each row's float terms are combined in the reference's order with the same operations
//! (no fused multiply-add), docs/design.md §2.2.
//!
//! # Layout by instruction set
//!
//! | folder            | variant        | what it holds                                     |
//! |-------------------|----------------|---------------------------------------------------|
//! | [`scalar`]        | `scalar`       | plain loops: the twins                             |
//! | [`portable`]      | `portable`     | `wide` vectors only, every target                  |
//! | `x86/avx2`        | `avx2`         | AVX2 + FMA + F16C                                  |
//! | `x86/avx512`      | `avx512vnni`   | AVX-512 BW + VNNI (the AVX2 code where it has none)|
//! | `aarch64/neon`    | `neon-dotprod` | NEON + `sdot` (floats: `portable`)                 |
//!
//! Each exposes the same names for the same shapes: `group_dot` / `group_tokens` (an
//! interleaved group of eight rows against one token / [`TOKENS`] tokens), `k4_row`,
//! `q6_k_row`, `iq4_xs_row`, `q2_k_row`, `q3_k_row`, `q5_1_row` (one whole row against `T`
//! tokens), `k4_group`, `q6_k_group`, `iq4_xs_group`, `q5_1_group` (eight whole rows),
//! `float_rows`. No instruction set imports another's files: what several share lives in
//! their parent (`x86/mod.rs` for AVX2 and AVX-512, `aarch64/neon/mod.rs` inside NEON) or in
//! the leaf modules here, which import no kernel (`blocks`: the block fields every
//! instruction set reads; `acts`, `packed`, `float`, `dequant`).

use crate::dtype::DType;

/// The types that are not interleaved (whole rows, or floats): the arm of a `match` on
/// [`DType`] in the interleaved kernels that cannot be reached (a new type lands here or
/// in the interleaved arms, and the compiler says which matches must learn it).
macro_rules! rows_or_float {
    () => {
        DType::F32
            | DType::F16
            | DType::BF16
            | DType::Q5_1
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::IQ4_XS
    };
}

/// Calls `$body` with `$dtype` as a literal constant in each arm, one arm per interleaved
/// code type: the always-inlined per-block steps then fold every `dtype` branch (a copy of
/// the loop per type). With the type a run-time value the AVX2 loop kept its branches and
/// spilled the unpacked codes to the stack, and the NEON one called its unpacking as a
/// function per block. Shared by `x86` and `aarch64` (defined before them).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! per_code_type {
    ($dtype:expr, $body:expr, ( $($arg:expr),* )) => {
        match $dtype {
            DType::Q4_0 => $body(DType::Q4_0, $($arg),*),
            DType::Q4_1 => $body(DType::Q4_1, $($arg),*),
            DType::Q5_0 => $body(DType::Q5_0, $($arg),*),
            DType::Q8_0 => $body(DType::Q8_0, $($arg),*),
            DType::IQ4_NL => $body(DType::IQ4_NL, $($arg),*),
            other @ (rows_or_float!()) => unreachable!("{other} is not interleaved"),
        }
    };
}

/// Runs `$body` with `T` a constant equal to the live token count `$n` (1..=[`TOKENS`];
/// larger counts run as [`TOKENS`]) and `$sub: &[_; T]` the first `T` of `$acts`: one
/// instance of a multi-token kernel per tile width, so a short tile computes only its
/// own tokens.
macro_rules! by_live_tokens {
    ($n:expr, $acts:expr, |$t:ident, $sub:ident| $body:block) => {
        match $n {
            1 => {
                const $t: usize = 1;
                let $sub = &[$acts[0]];
                $body
            }
            2 => {
                const $t: usize = 2;
                let $sub = &[$acts[0], $acts[1]];
                $body
            }
            3 => {
                const $t: usize = 3;
                let $sub = &[$acts[0], $acts[1], $acts[2]];
                $body
            }
            _ => {
                const $t: usize = TOKENS;
                let $sub: &[_; TOKENS] = $acts;
                $body
            }
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod acts;
pub mod blocks;
pub mod dequant;
pub mod float;
pub mod packed;
pub mod portable;
pub mod scalar;
mod variant;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use acts::{ActsForms, ActsTile, QuantizedActs, TileView, Q8K, TILE};
pub use blocks::QK;
pub use dequant::{dequantize_into, dequantize_row, DequantError};
pub use float::{FloatRows, RB};
pub(crate) use packed::qs_bytes;
pub use packed::{row_bytes, Group, Packed, STREAM_PREFETCH_BYTES};
pub use variant::{default_kernel, Kernel};

/// Runs `$e` (a `(code, Imp)`) where the build targets `$arch`, else the type's scalar
/// kernels (`$this(Kernel::Scalar)`; never reached: [`Kernels::new`] turns a variant this
/// CPU lacks into `scalar` first).
macro_rules! on {
    ($arch:literal, $this:expr, $e:expr) => {{
        #[cfg(target_arch = $arch)]
        let r = $e;
        #[cfg(not(target_arch = $arch))]
        let r = $this(Kernel::Scalar);
        r
    }};
}

/// The kernels of a float type `$e`: each variant's `float_rows::<$e>` over the bytes.
macro_rules! floats {
    ($e:ty) => {{
        fn this(v: Kernel) -> (Kernel, Imp) {
            match v {
                Kernel::Scalar => (
                    Kernel::Scalar,
                    Imp::Float(|w, c, r0, x, o, s| {
                        scalar::float_rows::<$e>(bytemuck::cast_slice(w), c, r0, x, o, s)
                    }),
                ),
                // `neon-dotprod` has no float code of its own: NEON through `wide`.
                Kernel::Portable | Kernel::NeonDotprod => (
                    Kernel::Portable,
                    Imp::Float(|w, c, r0, x, o, s| {
                        portable::float_rows::<$e>(bytemuck::cast_slice(w), c, r0, x, o, s)
                    }),
                ),
                // `avx512vnni` runs the AVX2 form (a 512-bit one measured slower).
                Kernel::Avx2 | Kernel::Avx512Vnni => on!("x86_64", this, {
                    let f: FloatFn = |w, c, r0, x, o, s| {
                        let w = bytemuck::cast_slice(w);
                        // SAFETY: the caller's (`FloatFn`): AVX2, FMA, F16C; rows in
                        // bounds.
                        unsafe { x86::avx2::float_rows::<$e>(w, c, r0, x, o, s) }
                    };
                    (Kernel::Avx2, Imp::Float(f))
                }),
            }
        }
        this
    }};
}

/// A row type's kernels from a one-row kernel generic in its token count (`$f::<T>`, then
/// any further generic arguments), against Q8_K (`k`) or blocks of 32 (`b`). The closures
/// are the table's `GroupFn` / `TokensFn`: their callers ([`Kernels`]) guarantee the row
/// kernel's instruction set and the shapes, which is what `k_rows` / `b_rows` need.
macro_rules! rows {
    ($form:ident, $($f:ident)::+ $(, $g:expr)?) => {
        Imp::Blocks {
            group: |d, g, a, o| {
                // SAFETY: the caller's (`GroupFn`), passed on.
                *o = unsafe { rows!(@walk $form, 1, d, g, &[a], $($f)::+::<1 $(, $g)?>) }[0]
            },
            tokens: |d, g, a, o, n| {
                by_live_tokens!(n, a, |T, sub| {
                    // SAFETY: the caller's (`TokensFn`), passed on.
                    let r = unsafe { rows!(@walk $form, T, d, g, sub, $($f)::+::<T $(, $g)?>) };
                    o[..T].copy_from_slice(&r);
                })
            },
            tile: None,
        }
    };
    (@walk k, $t:expr, $($rest:tt)*) => { k_rows::<{ $t }>($($rest)*) };
    (@walk b, $t:expr, $($rest:tt)*) => { b_rows::<{ $t }>($($rest)*) };
}

/// A row type's `portable` kernels: eight whole rows × `T` tokens (`$f::<T>`), safe code.
macro_rules! portable_groups {
    (k, $($f:ident)::+ $(, $g:expr)?) => {
        Imp::Blocks {
            group: |d, g, a, o| {
                *o = $($f)::+::<1 $(, $g)?>(g.qs, row_bytes(d, g.nb), &[&a.k])[0]
            },
            tokens: |d, g, a, o, n| {
                by_live_tokens!(n, a, |T, sub| {
                    let ks: [&Q8K; T] = std::array::from_fn(|t| &sub[t].k);
                    let r = $($f)::+::<T $(, $g)?>(g.qs, row_bytes(d, g.nb), &ks);
                    o[..T].copy_from_slice(&r);
                })
            },
            tile: None,
        }
    };
    (b, $($f:ident)::+) => {
        Imp::Blocks {
            group: |d, g, a, o| *o = $($f)::+::<1>(g.qs, row_bytes(d, g.nb), &[a])[0],
            tokens: |d, g, a, o, n| {
                by_live_tokens!(n, a, |T, sub| {
                    let r = $($f)::+::<T>(g.qs, row_bytes(d, g.nb), sub);
                    o[..T].copy_from_slice(&r);
                })
            },
            tile: None,
        }
    };
}

/// An x86 row type's kernels: a one-token group kernel `$group(qs, rb, acts)` and, for
/// several tokens, the AVX2 one-row kernel `$f::<TOKENS>` (`k`: Q8_K, `b`: blocks of 32).
#[cfg(target_arch = "x86_64")]
macro_rules! x86_group_rows {
    ($form:ident, $group:expr, $($f:ident)::+ $(, $g:expr)?) => {
        Imp::Blocks {
            group: |d, g, a, o| {
                // SAFETY: the caller's (`GroupFn`): the group kernel's instruction set, a
                // group of eight rows of `g.nb` blocks and as many activation blocks.
                *o = unsafe { $group(g.qs, row_bytes(d, g.nb), x86_group_rows!(@acts $form, a)) }
            },
            tokens: |d, g, a, o, n| {
                by_live_tokens!(n, a, |T, sub| {
                    // SAFETY: the caller's (`TokensFn`), passed on.
                    let r = unsafe { rows!(@walk $form, T, d, g, sub, $($f)::+::<T $(, $g)?>) };
                    o[..T].copy_from_slice(&r);
                })
            },
            tile: None,
        }
    };
    (@acts k, $a:expr) => { &$a.k };
    (@acts b, $a:expr) => { $a };
}

/// Rows per group (interleaved or whole).
pub const GROUP: usize = 8;

/// Tokens one multi-token kernel call serves: each weight block is loaded and unpacked
/// once for this many activation blocks.
pub const TOKENS: usize = 4;

/// The activation format a weight type reads ([`acts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acts {
    /// The f32 vector itself (float weights).
    F32,
    /// 8-bit blocks of 32 with their scales and sums (ggml's Q8_0, and Q8_1's role for the
    /// types with minimums).
    Q8_0,
    /// Q8_K super-blocks of 256 with their group sums.
    Q8K,
}

/// How a matrix of a weight type is held for its kernels ([`packed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The file's rows, read in place (mapped or owned bytes).
    Float,
    /// Repacked: eight rows interleaved per block of 32.
    Interleaved,
    /// Repacked: groups of eight whole rows, as in the file.
    Rows,
}

/// One row of the type table.
#[derive(Clone, Copy)]
pub struct Entry {
    /// The activation format the type's kernels read.
    pub acts: Acts,
    /// How a matrix of the type is held.
    pub layout: Layout,
    /// The engine's dequantiser (`bytes` of whole blocks → `out.len()` values).
    pub dequant: Dequant,
    /// The kernels each variant runs for the type (and whose code that is).
    kernels: Resolve,
}

/// The table: every weight type's row.
pub fn entry(dtype: DType) -> Entry {
    use Acts::{Q8K, Q8_0};
    use Layout::{Interleaved, Rows};
    let (acts, layout, dequant, kernels): (Acts, Layout, Dequant, Resolve) = match dtype {
        DType::F32 => (Acts::F32, Layout::Float, dequant::f32s, floats!(f32)),
        DType::F16 => (Acts::F32, Layout::Float, dequant::f16s, floats!(half::f16)),
        DType::BF16 => (
            Acts::F32,
            Layout::Float,
            dequant::bf16s,
            floats!(half::bf16),
        ),
        DType::Q8_0 => (Q8_0, Interleaved, dequant::q8_0, interleaved),
        DType::Q4_0 => (Q8_0, Interleaved, dequant::q4_0, interleaved),
        DType::Q4_1 => (Q8_0, Interleaved, dequant::q4_1, interleaved),
        DType::Q5_0 => (Q8_0, Interleaved, dequant::q5_0, interleaved),
        DType::IQ4_NL => (Q8_0, Interleaved, dequant::iq4_nl, interleaved),
        DType::Q5_1 => (Q8_0, Rows, dequant::q5_1, q5_1),
        DType::Q2_K => (Q8K, Rows, dequant::q2_k, q2_k),
        DType::Q3_K => (Q8K, Rows, dequant::q3_k, q3_k),
        DType::Q4_K => (Q8K, Rows, dequant::q4_k, q4_k),
        DType::Q5_K => (Q8K, Rows, dequant::q5_k, q5_k),
        DType::Q6_K => (Q8K, Rows, dequant::q6_k, q6_k),
        DType::IQ4_XS => (Q8K, Rows, dequant::iq4_xs, iq4_xs),
    };
    Entry {
        acts,
        layout,
        dequant,
        kernels,
    }
}

/// A type's kernel selector: the variant's functions for it, and whose code they are.
type Resolve = fn(Kernel) -> (Kernel, Imp);
/// A dequantiser of whole blocks.
pub type Dequant = fn(&[u8], &mut [f32]);

// The kernels' function types. Their contract (what [`Kernels`] guarantees before every
// call, and [`Kernels::new`] when it hands them out): the instruction set of the code is
// available on this CPU; the group belongs to a [`Packed`] matrix of the `DType` passed;
// every token holds the activation form of the type's [`Entry::acts`] with as many blocks
// as the group's rows; a float matrix's rows `r0..r0 + out.len()` and `x[..cols]` are in
// bounds.

/// Eight rows of a group × one token (`out[k]` = row `8g + k`).
type GroupFn = unsafe fn(DType, &Group, &QuantizedActs, &mut [f32; GROUP]);
/// The fewest tokens a tile kernel ([`Kernels::group_tile`]) takes; fewer go through the
/// multi-token kernel. The AVX-512 tile computes four token lanes (eight past four)
/// whatever the live count, so for two tokens half its work is thrown away: a SmolLM2
/// Q4_1 pass of 2 tokens (a speculative verification of one draft, or two sequences in a
/// `serve` step) took 9.4 ms through the tile, 8.3–9.0 ms through `tokens_512::<2>`
/// (plain step 6.5–7.2 ms; 3 tokens: 10.0 either way). `cargo bench --bench speculate`,
/// 1 thread, the Zen 4 host, 2 alternated rounds.
pub const TILE_MIN_TOKENS: usize = 3;

/// Eight rows of a group × the first `n` (1..=[`TOKENS`]) tokens of a tile (`out[t][k]`,
/// `t < n`; `out[n..]` is left as it is): a short tile costs its own tokens, not
/// [`TOKENS`] (a speculative verification pass has 2–9 tokens).
type TokensFn =
    unsafe fn(DType, &Group, &[&QuantizedActs; TOKENS], &mut [[f32; GROUP]; TOKENS], usize);
/// Eight rows of a group × a tile's first `n` tokens (`out[t][k]`, `t < n`).
type TileFn = unsafe fn(DType, &Group, &TileView, &mut [[f32; GROUP]; TILE], usize, bool);
/// Float rows `r0..r0 + out.len()` (of `cols` values, as bytes) × `x`.
type FloatFn = unsafe fn(&[u8], usize, usize, &[f32], &mut [f32], bool);
/// One whole row × `T` tokens' Q8_K super-blocks.
type KRow<const T: usize> = unsafe fn(&[u8], &[&Q8K; T]) -> [f32; T];
/// One whole row × `T` tokens' 8-bit blocks of 32.
type BRow<const T: usize> = unsafe fn(&[u8], &[&QuantizedActs; T]) -> [f32; T];

/// The functions a variant runs for a type.
#[derive(Clone, Copy)]
enum Imp {
    Float(FloatFn),
    Blocks {
        group: GroupFn,
        tokens: TokensFn,
        tile: Option<TileFn>,
    },
}

/// The kernels of one matrix: its type's row of the table, resolved for one variant.
///
/// Built only by [`Kernels::new`], which hands out an instruction set's functions only
/// when this CPU has it; every entry point checks the shapes the kernels rely on.
#[derive(Clone, Copy)]
pub struct Kernels {
    variant: Kernel,
    code: Kernel,
    dtype: DType,
    acts: Acts,
    imp: Imp,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Kernels({} {}, code {})",
            self.dtype,
            self.variant.name(),
            self.code.name()
        )
    }
}

impl Kernels {
    /// The kernels `variant` runs for `dtype`; a variant this CPU does not support runs the
    /// scalar twins.
    pub fn new(variant: Kernel, dtype: DType) -> Kernels {
        let variant = if variant.is_supported() {
            variant
        } else {
            Kernel::Scalar
        };
        let e = entry(dtype);
        let (code, imp) = (e.kernels)(variant);
        Kernels {
            variant,
            code,
            dtype,
            acts: e.acts,
            imp,
        }
    }

    /// The variant these kernels were resolved for.
    pub fn variant(&self) -> Kernel {
        self.variant
    }

    /// Whose code runs: the variant's own, or the one it borrows for this type (the
    /// `avx512vnni` variant runs the AVX2 code of most row types, `neon-dotprod` the
    /// portable float rows). Only `scalar` runs the scalar twins.
    pub fn code(&self) -> Kernel {
        self.code
    }

    /// The activation format they read.
    pub fn acts(&self) -> Acts {
        self.acts
    }

    /// The group kernels, or a panic naming the misuse (a float matrix is not packed).
    #[inline]
    fn blocks(&self, p: &Packed) -> (GroupFn, TokensFn, Option<TileFn>) {
        assert_eq!(p.dtype, self.dtype, "kernels of another type");
        match self.imp {
            Imp::Blocks {
                group,
                tokens,
                tile,
            } => (group, tokens, tile),
            Imp::Float(_) => panic!("{} rows are not packed", self.dtype),
        }
    }

    /// Checks that `a` holds the form these kernels read, `nb` blocks of it.
    #[inline]
    fn check(&self, a: &QuantizedActs, nb: usize) {
        match self.acts {
            Acts::Q8_0 => assert_eq!(a.blocks(), nb, "activation blocks vs matrix blocks"),
            Acts::Q8K => assert_eq!(a.k.blocks(), nb, "Q8_K super-blocks vs matrix"),
            Acts::F32 => unreachable!("float kernels read no quantised activations"),
        }
    }

    /// `out[k] = row (8g + k) · a` for group `g` of `p` (a matrix of this type).
    #[inline]
    pub fn group_dot(&self, p: &Packed, g: usize, a: &QuantizedActs, out: &mut [f32; GROUP]) {
        let (group, _, _) = self.blocks(p);
        let grp = p.group(g);
        self.check(a, grp.nb);
        // SAFETY: `new` resolved these functions for an instruction set this CPU has;
        // `grp` is a group of a packed matrix of their type (asserted in `blocks`), and
        // `a` holds the form they read with as many blocks (asserted in `check`).
        unsafe { group(self.dtype, &grp, a, out) }
    }

    /// `out[j][k] = row (8g + k) · acts[j]` for every token `j` (any count), [`TOKENS`] at
    /// a time, each weight block unpacked once per call for all of them. Every value
    /// equals [`Kernels::group_dot`]'s for that token alone, bit for bit.
    pub fn group_tokens(
        &self,
        p: &Packed,
        g: usize,
        acts: &[&QuantizedActs],
        out: &mut [[f32; GROUP]],
    ) {
        assert_eq!(acts.len(), out.len(), "one output row per token");
        let (_, tokens, _) = self.blocks(p);
        let grp = p.group(g);
        for (a, o) in acts.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
            // A short last tile repeats its last token; the extra results are dropped.
            let tile: [&QuantizedActs; TOKENS] = std::array::from_fn(|j| a[j.min(a.len() - 1)]);
            for t in &tile {
                self.check(t, grp.nb);
            }
            let mut buf = [[0.0f32; GROUP]; TOKENS];
            // SAFETY: as in `group_dot`, for every token of the tile (checked above).
            unsafe { tokens(self.dtype, &grp, &tile, &mut buf, a.len()) };
            o.copy_from_slice(&buf[..o.len()]);
        }
    }

    /// `out[t][k] = row (8g + k) · tile token t` for every token of the tile: as
    /// [`Kernels::group_tokens`] (bit for bit the one-token values); the `avx512vnni`
    /// variant's interleaved types read the tile's interleaved copy (no cross-lane
    /// reduction: each `vpdpbusd` lane sums one row × one token), except a tile of fewer than
    /// [`TILE_MIN_TOKENS`] tokens, which goes through the multi-token kernel.
    ///
    /// `last`: this is the last tile that meets group `g` before the next group; the kernel
    /// then asks for the next group's lines as it goes (with more tiles to come, the group
    /// stays in cache between them and a prefetch in each would only repeat itself: a
    /// 2,000-token SmolLM2 prefill ran 1–3% slower with one in every tile).
    pub fn group_tile(
        &self,
        p: &Packed,
        g: usize,
        tile: &ActsTile,
        out: &mut [[f32; GROUP]],
        last: bool,
    ) {
        assert_eq!(out.len(), tile.len(), "one output row per token");
        let (_, _, tile_fn) = self.blocks(p);
        let Some(tile_fn) = tile_fn.filter(|_| tile.len() >= TILE_MIN_TOKENS) else {
            return self.group_tokens(p, g, tile.tokens(), out);
        };
        let grp = p.group(g);
        let view = tile.view();
        assert_eq!(grp.nb, view.nb, "activation blocks vs matrix blocks");
        let mut buf = [[0.0f32; GROUP]; TILE];
        // SAFETY: as in `group_dot`; the tile holds `grp.nb` blocks of every token
        // (asserted above; its arrays are sized by `ActsTile::new`).
        unsafe { tile_fn(self.dtype, &grp, &view, &mut buf, tile.len(), last) };
        let n = out.len();
        out.copy_from_slice(&buf[..n]);
    }

    /// `out[j] = row (r0 + j) · x` for a float matrix whose row-major bytes are `w`
    /// (`cols` values per row). `streamed` chooses how the rows are walked
    /// ([`crate::ops::Matrix::set_streamed`]), never the values.
    #[inline]
    pub fn float_rows(
        &self,
        w: &[u8],
        cols: usize,
        r0: usize,
        x: &[f32],
        out: &mut [f32],
        streamed: bool,
    ) {
        let Imp::Float(rows) = self.imp else {
            panic!("{} is not a float type", self.dtype);
        };
        let row_bytes = cols * self.dtype.block_bytes();
        assert!(x.len() >= cols && (r0 + out.len()) * row_bytes <= w.len());
        if out.is_empty() {
            return;
        }
        // SAFETY: `new` resolved `rows` for an instruction set this CPU has; the rows read
        // (`r0..r0 + out.len()`) and `x[..cols]` are in bounds (asserted above).
        unsafe { rows(w, cols, r0, x, out, streamed) }
    }
}

/// Eight whole rows through `row` (one row × `T` tokens' Q8_K forms).
///
/// # Safety
/// `row`'s: its instruction set is available, each row holds `g.nb` super-blocks of
/// `dtype` and every token as many.
#[inline(always)]
unsafe fn k_rows<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    row: KRow<T>,
) -> [[f32; GROUP]; T] {
    let rb = row_bytes(dtype, g.nb);
    let ks: [&Q8K; T] = std::array::from_fn(|t| &acts[t].k);
    let mut out = [[0.0f32; GROUP]; T];
    for r in 0..GROUP {
        // SAFETY: the caller's.
        let v = unsafe { row(&g.qs[r * rb..(r + 1) * rb], &ks) };
        for (o, vt) in out.iter_mut().zip(v) {
            o[r] = vt;
        }
    }
    out
}

/// Eight whole rows through `row` (one row × `T` tokens' blocks of 32).
///
/// # Safety
/// As for [`k_rows`].
#[inline(always)]
unsafe fn b_rows<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    row: BRow<T>,
) -> [[f32; GROUP]; T] {
    let rb = row_bytes(dtype, g.nb);
    let mut out = [[0.0f32; GROUP]; T];
    for r in 0..GROUP {
        // SAFETY: the caller's.
        let v = unsafe { row(&g.qs[r * rb..(r + 1) * rb], acts) };
        for (o, vt) in out.iter_mut().zip(v) {
            o[r] = vt;
        }
    }
    out
}

/// The interleaved types (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL): each variant's `group_dot` and
/// `group_tokens` (one `per_code_type!` copy of the loop per type inside).
fn interleaved(v: Kernel) -> (Kernel, Imp) {
    let blocks = |group: GroupFn, tokens: TokensFn| Imp::Blocks {
        group,
        tokens,
        tile: None,
    };
    match v {
        Kernel::Scalar => (v, blocks(scalar::group_dot, scalar::group_tokens)),
        Kernel::Portable => (v, blocks(portable::group_dot, portable::group_tokens)),
        Kernel::Avx2 => on!("x86_64", interleaved, {
            (v, blocks(x86::avx2::group_dot, x86::avx2::group_tokens))
        }),
        Kernel::Avx512Vnni => on!("x86_64", interleaved, {
            let tile: TileFn = x86::avx512::group_tile;
            let imp = Imp::Blocks {
                group: x86::avx512::group_dot,
                tokens: x86::avx512::group_tokens,
                tile: Some(tile),
            };
            (v, imp)
        }),
        Kernel::NeonDotprod => on!("aarch64", interleaved, {
            (
                v,
                blocks(aarch64::neon::group_dot, aarch64::neon::group_tokens),
            )
        }),
    }
}

/// Q5_1: whole rows against the 8-bit blocks of 32, Q4_1's float steps.
fn q5_1(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(b, scalar::q5_1_row)),
        Kernel::Portable => (v, portable_groups!(b, portable::q5_1_group)),
        Kernel::Avx2 => on!("x86_64", q5_1, {
            let imp = x86_group_rows!(b, x86::avx2::q5_1_group, x86::avx2::q5_1_row);
            (v, imp)
        }),
        Kernel::Avx512Vnni => on!("x86_64", q5_1, {
            let imp = x86_group_rows!(b, x86::avx512::q5_1_group, x86::avx2::q5_1_row);
            (v, imp)
        }),
        Kernel::NeonDotprod => on!("aarch64", q5_1, { (v, rows!(b, aarch64::neon::q5_1_row)) }),
    }
}

/// Q4_K and Q5_K (`FIVE`): the same kernels, the fifth bit a const parameter.
fn k4<const FIVE: bool>(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(k, scalar::k4_row, FIVE)),
        Kernel::Portable => (v, portable_groups!(k, portable::k4_group, FIVE)),
        Kernel::Avx2 => on!("x86_64", k4::<FIVE>, {
            let imp = x86_group_rows!(k, x86::avx2::k4_group::<FIVE>, x86::avx2::k4_row, FIVE);
            (v, imp)
        }),
        Kernel::Avx512Vnni => on!("x86_64", k4::<FIVE>, {
            let imp = x86_group_rows!(k, x86::avx512::k4_group::<FIVE>, x86::avx2::k4_row, FIVE);
            (v, imp)
        }),
        Kernel::NeonDotprod => on!("aarch64", k4::<FIVE>, {
            (v, rows!(k, aarch64::neon::k4_row, FIVE))
        }),
    }
}

fn q4_k(v: Kernel) -> (Kernel, Imp) {
    k4::<false>(v)
}

fn q5_k(v: Kernel) -> (Kernel, Imp) {
    k4::<true>(v)
}

fn q6_k(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(k, scalar::q6_k_row)),
        Kernel::Portable => (v, portable_groups!(k, portable::q6_k_group)),
        Kernel::Avx2 => on!("x86_64", q6_k, {
            (
                v,
                x86_group_rows!(k, x86::avx2::q6_k_group, x86::avx2::q6_k_row),
            )
        }),
        Kernel::Avx512Vnni => on!("x86_64", q6_k, {
            (
                v,
                x86_group_rows!(k, x86::avx512::q6_k_group, x86::avx2::q6_k_row),
            )
        }),
        Kernel::NeonDotprod => on!("aarch64", q6_k, { (v, rows!(k, aarch64::neon::q6_k_row)) }),
    }
}

/// IQ4_XS: `avx512vnni` runs the AVX2 group kernel.
fn iq4_xs(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(k, scalar::iq4_xs_row)),
        Kernel::Portable => (v, portable_groups!(k, portable::iq4_xs_group)),
        Kernel::Avx2 | Kernel::Avx512Vnni => on!("x86_64", iq4_xs, {
            let imp = x86_group_rows!(k, x86::avx2::iq4_xs_group, x86::avx2::iq4_xs_row);
            (Kernel::Avx2, imp)
        }),
        Kernel::NeonDotprod => on!("aarch64", iq4_xs, {
            (v, rows!(k, aarch64::neon::iq4_xs_row))
        }),
    }
}

/// Q2_K: one row at a time on x86 and NEON (`avx512vnni` runs the AVX2 rows).
fn q2_k(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(k, scalar::q2_k_row)),
        Kernel::Portable => (v, portable_groups!(k, portable::q2_k_group)),
        Kernel::Avx2 | Kernel::Avx512Vnni => on!("x86_64", q2_k, {
            (Kernel::Avx2, rows!(k, x86::avx2::q2_k_row))
        }),
        Kernel::NeonDotprod => on!("aarch64", q2_k, { (v, rows!(k, aarch64::neon::q2_k_row)) }),
    }
}

/// Q3_K: as Q2_K.
fn q3_k(v: Kernel) -> (Kernel, Imp) {
    match v {
        Kernel::Scalar => (v, rows!(k, scalar::q3_k_row)),
        Kernel::Portable => (v, portable_groups!(k, portable::q3_k_group)),
        Kernel::Avx2 | Kernel::Avx512Vnni => on!("x86_64", q3_k, {
            (Kernel::Avx2, rows!(k, x86::avx2::q3_k_row))
        }),
        Kernel::NeonDotprod => on!("aarch64", q3_k, { (v, rows!(k, aarch64::neon::q3_k_row)) }),
    }
}
