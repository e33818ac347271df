//! KIVI quantiser properties (docs/design.md §2), for the engine's kernels and the reference:
//! the engine's own quantisers, packing, unpacking and dequantisers (`tinygpt_cpu::kivi`)
//! against their twins in `tinygpt_reference::quant`, bit for bit, and the known failure
//! classes pushed through whole caches.
//!
//! Error budgets (named, used below):
//! * `Affine::error_bound`: round trip `|x − x'| ≤ scale/2 + levels·max(0, scale32 − scale)
//!   + |lo − zero|` (+ f32 ulps), i.e. half a step plus the f16 rounding of scale and zero.
//! * `FP32_VS_KIVI_TINY`: attention output of a KIVI cache vs an fp32 cache when every
//!   value is ~1e-7 (the quantisation error is below 1e-5 there).

use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, RngSeed};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeSet;
use tinygpt_cpu::attention::{attend, AttnScratch, RopeTable};
use tinygpt_cpu::config::{Config, RopeScaling};
use tinygpt_cpu::kivi::{self as q, Bits};
use tinygpt_cpu::kv_cache::{KvConfig, KvRotation, LayerKv, PositionsMode, Precision};
use tinygpt_reference::kv_cache::LayerCache;
use tinygpt_reference::quant::{self as r, Affine};
use tinygpt_reference::rope::Rope;

const FP32_VS_KIVI_TINY: f32 = 1e-5;

fn rbits(b: Bits) -> r::Bits {
    match b {
        Bits::Int8 => r::Bits::Int8,
        Bits::Int4 => r::Bits::Int4,
        Bits::Int2 => r::Bits::Int2,
    }
}

fn pt_config(cases: u32, seed: u64) -> PtConfig {
    PtConfig {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..PtConfig::default()
    }
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        })
}

/// A random slice: `len` values `offset + amp·u`, `u ∈ [-1, 1]`.
fn slice_strategy() -> impl Strategy<Value = Vec<f32>> {
    let amps = prop::sample::select(vec![0.0f32, 1e-7, 1e-4, 0.1, 1.0, 30.0, 1000.0, 30000.0]);
    let offsets = prop::sample::select(vec![0.0f32, 1e-7, -0.5, 3.0, -200.0, 30000.0, -32000.0]);
    (1usize..70, amps, offsets, any::<u64>()).prop_map(|(len, amp, off, seed)| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..len)
            .map(|_| off + amp * rng.gen_range(-1.0f32..=1.0))
            .collect()
    })
}

proptest! {
    #![proptest_config(pt_config(2000, 0x5EED_0001))]

    /// Every element round-trips within half a step (+ the f16 rounding of scale/zero);
    /// engine and reference agree bit for bit on parameters, bytes and values.
    #[test]
    fn round_trip_within_bound(
        x in slice_strategy(),
        bits in prop::sample::select(vec![Bits::Int8, Bits::Int4, Bits::Int2]),
    ) {
        let rb = rbits(bits);
        let (lo, hi) = min_max(&x);
        let (codes, a) = r::quantize_row(&x, rb);
        let bound = a.error_bound(lo, hi, rb);
        for (j, (&v, &c)) in x.iter().zip(&codes).enumerate() {
            prop_assert!((bits.qmin()..=bits.qmax()).contains(&c), "j={} code {}", j, c);
            let back = a.dequantize(c, rb);
            prop_assert!(back.is_finite());
            prop_assert!((v - back).abs() <= bound,
                "bits={:?} j={} x={} x'={} err={} bound={} lo={} hi={} scale={} zero={}",
                bits, j, v, back, (v - back).abs(), bound, lo, hi, a.scale, a.zero);
        }
        // Engine, per-token path.
        let mut bytes = vec![0u8; bits.packed_len(x.len())];
        let (s, z) = q::quantize_token(&x, bits, &mut bytes);
        prop_assert_eq!((s, z), (a.scale, a.zero));
        prop_assert_eq!(&bytes, &r::pack_codes(&codes, rb));
        let mut back = vec![0.0f32; x.len()];
        q::dequantize_token(&bytes, s, z, bits, &mut back);
        for j in 0..x.len() {
            prop_assert_eq!(back[j].to_bits(), a.dequantize(codes[j], rb).to_bits(), "j={}", j);
        }
        // Engine, per-channel path with per-element parameters (here all equal).
        let sf = vec![s.to_f32(); x.len()];
        let zf = vec![z.to_f32(); x.len()];
        let mut bytes2 = vec![0xA5u8; bits.packed_len(x.len())];
        q::quantize_channels(&x, &sf, &zf, bits, &mut bytes2);
        prop_assert_eq!(&bytes2, &bytes);
        let mut back2 = vec![0.0f32; x.len()];
        q::dequantize_channels(&bytes2, &sf, &zf, bits, &mut back2);
        prop_assert_eq!(back2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        back.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // Parameters as the engine computes them from a range.
        prop_assert_eq!(q::params(lo, hi, bits), (a.scale, a.zero));
    }
}

/// The K-group lengths of the property tests: one token, and each side of the group
/// sizes the tests and the default use (4, 8, 16, 32 tokens).
const GROUP_LENGTHS: [usize; 14] = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33];

/// `t` K rows of `hd` channels, each channel drawn whole from one kind: random around an
/// offset, constant (hi = lo), extreme (near and beyond f16's ±65504), tiny (f16 scale
/// underflow) or random with one outlier token.
fn k_group(hd: usize, t: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut rows = vec![vec![0.0f32; hd]; t];
    for c in 0..hd {
        let kind = rng.gen_range(0..5);
        let offset = [0.0f32, -0.5, 3.0, -200.0, 30000.0][rng.gen_range(0..5)];
        let amp = [1e-4f32, 0.1, 1.0, 30.0, 1000.0][rng.gen_range(0..5)];
        let constant = [0.0f32, 1e-7, 3.25, -65504.0, 65504.0, 1e9][rng.gen_range(0..6)];
        let outlier = rng.gen_range(0..t);
        for (i, row) in rows.iter_mut().enumerate() {
            let u = rng.gen_range(-1.0f32..=1.0);
            row[c] = match kind {
                0 => offset + amp * u,
                1 => constant,
                2 => u.signum() * rng.gen_range(6.0e4f32..1.0e9),
                3 => 1e-7 + 5e-8 * u,
                _ if i == outlier => 40.0 * amp,
                _ => amp * u,
            };
        }
    }
    rows
}

proptest! {
    #![proptest_config(pt_config(1500, 0x5EED_0002))]

    /// A K group as the cache quantises it (`kv_cache::storage::kivi_k`): per channel, the
    /// engine's `min_max` and `params` over the group's `t` rows, then every row packed
    /// with the engine's `quantize_channels`; against the reference's per-channel fit
    /// (`quantize_row` of the channel) and `pack_codes`, bit for bit: parameters, bytes,
    /// every code as the engine's `get` reads it, and values from `dequantize_channels`
    /// and its SIMD twin. Random shapes (odd head dims included), every bit width.
    #[test]
    fn k_group_matches_reference_per_channel(
        bits in prop::sample::select(vec![Bits::Int8, Bits::Int4, Bits::Int2]),
        hd in 1usize..72,
        t in prop::sample::select(GROUP_LENGTHS.to_vec()),
        seed in any::<u64>(),
    ) {
        let rb = rbits(bits);
        let rows = k_group(hd, t, seed);
        let channel = |c: usize| rows.iter().map(|r| r[c]).collect::<Vec<f32>>();
        let want: Vec<(Vec<i32>, Affine)> = (0..hd).map(|c| r::quantize_row(&channel(c), rb)).collect();
        let params: Vec<_> = (0..hd)
            .map(|c| {
                let (lo, hi) = q::min_max(&channel(c));
                q::params(lo, hi, bits)
            })
            .collect();
        for c in 0..hd {
            prop_assert_eq!(params[c], (want[c].1.scale, want[c].1.zero), "channel {}", c);
        }
        let s32: Vec<f32> = params.iter().map(|p| p.0.to_f32()).collect();
        let z32: Vec<f32> = params.iter().map(|p| p.1.to_f32()).collect();
        for (i, row) in rows.iter().enumerate() {
            let codes: Vec<i32> = (0..hd).map(|c| want[c].0[i]).collect();
            let mut bytes = vec![0xA5u8; bits.packed_len(hd)];
            q::quantize_channels(row, &s32, &z32, bits, &mut bytes);
            prop_assert_eq!(&bytes, &r::pack_codes(&codes, rb), "row {}", i);
            let got: Vec<i32> = (0..hd).map(|c| q::get(&bytes, c, bits) as i32 + bits.qmin()).collect();
            prop_assert_eq!(&got, &codes, "row {}", i);
            let (mut back, mut simd) = (vec![0.0f32; hd], vec![0.0f32; hd]);
            q::dequantize_channels(&bytes, &s32, &z32, bits, &mut back);
            q::dequantize_channels_simd(&bytes, &s32, &z32, bits, &mut simd);
            for c in 0..hd {
                let w = want[c].1.dequantize(codes[c], rb);
                prop_assert!(back[c].is_finite(), "row {} channel {}: {}", i, c, back[c]);
                prop_assert_eq!(back[c].to_bits(), w.to_bits(), "row {} channel {}", i, c);
                prop_assert_eq!(simd[c].to_bits(), w.to_bits(), "simd row {} channel {}", i, c);
            }
        }
    }

    /// The engine's unpacking (`get`) against the reference's `unpack_codes` on arbitrary
    /// bytes (every code at every position of a byte), every bit width and length.
    #[test]
    fn get_matches_reference_unpack(
        bits in prop::sample::select(vec![Bits::Int8, Bits::Int4, Bits::Int2]),
        bytes in prop::collection::vec(any::<u8>(), 1..80),
    ) {
        let rb = rbits(bits);
        let per_byte = 8 / bits.width() as usize;
        let n = bytes.len() * per_byte;
        for len in [n, n - per_byte + 1] {
            let want = r::unpack_codes(&bytes, len, rb);
            let got: Vec<i32> = (0..len).map(|j| q::get(&bytes, j, bits) as i32 + bits.qmin()).collect();
            prop_assert_eq!(got, want, "len {}", len);
        }
    }
}

/// The engine's saturating f16 conversion (every stored scale and zero goes through it)
/// against the reference's, bit for bit: every f16 value, the midpoints around them (ties
/// and the overflow threshold), and a spread of arbitrary f32 bit patterns.
#[test]
fn f16_saturating_matches_reference() {
    let f16s: Vec<f32> = (0..=0x7c00u16)
        .map(|b| half::f16::from_bits(b).to_f32())
        .collect();
    // Every positive f16 (and +inf), one f32 ulp either side, and the exact midpoint
    // between neighbours (a tie); then the overflow threshold (65520) and beyond.
    let mut xs: Vec<f32> = f16s
        .iter()
        .flat_map(|&x| {
            [
                x,
                f32::from_bits(x.to_bits() + 1),
                f32::from_bits(x.to_bits().max(1) - 1),
            ]
        })
        .chain(
            f16s.windows(2)
                .map(|w| ((w[0] as f64 + w[1] as f64) / 2.0) as f32),
        )
        .collect();
    xs.extend([65519.99, 65520.0, 65536.0, 1e9, f32::MAX, f32::NAN]);
    xs.extend(xs.clone().iter().map(|x| -x));
    let mut rng = ChaCha8Rng::seed_from_u64(0xF16);
    xs.extend((0..1 << 20).map(|_| f32::from_bits(rng.gen())));
    for x in xs {
        let (got, want) = (q::f16_saturating(x), r::f16_saturating(x));
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}

/// A dense sweep of `[lo, hi]` reaches every code in `[qmin, qmax]`, in both paths.
#[test]
fn every_code_is_reachable() {
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        for (lo, hi) in [
            (-1.0f32, 1.0f32),
            (0.0, 255.0),
            (-3.7, 12.1),
            (1000.0, 1001.0),
            (-0.02, 0.0),
        ] {
            let n = 8 * (bits.qmax() - bits.qmin()) as usize + 1;
            let x: Vec<f32> = (0..n)
                .map(|i| lo + (hi - lo) * i as f32 / (n - 1) as f32)
                .collect();
            let (codes, _) = r::quantize_row(&x, rbits(bits));
            let got: BTreeSet<i32> = codes.iter().copied().collect();
            let all: BTreeSet<i32> = (bits.qmin()..=bits.qmax()).collect();
            assert_eq!(got, all, "reference bits={bits:?} [{lo}, {hi}]");
            let mut bytes = vec![0u8; bits.packed_len(n)];
            q::quantize_token(&x, bits, &mut bytes);
            let got: BTreeSet<i32> = (0..n)
                .map(|j| q::get(&bytes, j, bits) as i32 + bits.qmin())
                .collect();
            assert_eq!(got, all, "engine bits={bits:?} [{lo}, {hi}]");
        }
    }
}

/// int4 packing is the identity on all 16 codes at both nibble positions, and its layout
/// is pinned: element 2j in the low nibble, stored offset-binary (q − qmin).
#[test]
fn int4_pack_unpack_identity_and_layout() {
    for a in r::INT4_QMIN..=r::INT4_QMAX {
        for b in r::INT4_QMIN..=r::INT4_QMAX {
            let packed = r::pack_codes(&[a, b], r::Bits::Int4);
            assert_eq!(
                packed,
                vec![((a + 8) | ((b + 8) << 4)) as u8],
                "a={a} b={b}"
            );
            assert_eq!(
                r::unpack_codes(&packed, 2, r::Bits::Int4),
                vec![a, b],
                "a={a} b={b}"
            );
            // Engine: with scale 1 and zero 0, value u quantises to code u (offset-binary).
            let (ua, ub) = ((a + 8) as f32, (b + 8) as f32);
            let mut bytes = [0u8; 1];
            q::quantize_channels(&[ua, ub], &[1.0, 1.0], &[0.0, 0.0], Bits::Int4, &mut bytes);
            assert_eq!(bytes.to_vec(), packed, "engine a={a} b={b}");
            assert_eq!(
                (q::get(&bytes, 0, Bits::Int4), q::get(&bytes, 1, Bits::Int4)),
                ((a + 8) as u8, (b + 8) as u8)
            );
            let mut back = [0.0f32; 2];
            q::dequantize_channels(&bytes, &[1.0, 1.0], &[0.0, 0.0], Bits::Int4, &mut back);
            assert_eq!(back, [ua, ub]);
        }
    }
    // Literal bytes: q = [-8, 7, 0, -1, 3] → [0xF0, 0x78, 0x0B] (odd length: high nibble 0).
    assert_eq!(
        r::pack_codes(&[-8, 7, 0, -1, 3], r::Bits::Int4),
        vec![0xF0, 0x78, 0x0B]
    );
    let mut bytes = [0xFFu8; 3];
    q::quantize_channels(
        &[0.0, 15.0, 8.0, 7.0, 11.0],
        &[1.0; 5],
        &[0.0; 5],
        Bits::Int4,
        &mut bytes,
    );
    assert_eq!(bytes, [0xF0, 0x78, 0x0B]);
    // int8 is offset-binary too: q = [-128, 127, 0] → [0x00, 0xFF, 0x80].
    assert_eq!(
        r::pack_codes(&[-128, 127, 0], r::Bits::Int8),
        vec![0x00, 0xFF, 0x80]
    );
}

/// int2 packing is the identity on all 4 codes at all 4 positions, and its layout is
/// pinned: element 4j + i in bits 2i..2i+2 of byte j, stored offset-binary (q − qmin).
#[test]
fn int2_pack_unpack_identity_and_layout() {
    for u in 0..4i32 {
        for pos in 0..4usize {
            let mut q = [-2i32; 4];
            q[pos] = u - 2;
            let packed = r::pack_codes(&q, r::Bits::Int2);
            assert_eq!(packed, vec![(u as u8) << (2 * pos)], "u={u} pos={pos}");
            assert_eq!(r::unpack_codes(&packed, 4, r::Bits::Int2), q.to_vec());
            let x: Vec<f32> = q.iter().map(|&c| (c + 2) as f32).collect();
            let mut bytes = [0xFFu8; 1];
            q::quantize_channels(&x, &[1.0; 4], &[0.0; 4], Bits::Int2, &mut bytes);
            assert_eq!(bytes.to_vec(), packed, "engine u={u} pos={pos}");
        }
    }
    // q = [-2, 1, 0, -1, 1] → u = [0, 3, 2, 1, 3] → bytes [0b01_10_11_00, 0b11] = [0x6C, 0x03]
    assert_eq!(
        r::pack_codes(&[-2, 1, 0, -1, 1], r::Bits::Int2),
        vec![0x6C, 0x03]
    );
    let mut bytes = [0xFFu8; 2];
    q::quantize_channels(
        &[0.0, 3.0, 2.0, 1.0, 3.0],
        &[1.0; 5],
        &[0.0; 5],
        Bits::Int2,
        &mut bytes,
    );
    assert_eq!(bytes, [0x6C, 0x03]);
}

/// Exact halves round to even (`round_ties_even`), never away from zero.
#[test]
fn ties_round_to_even() {
    // scale 1, zero 0: (x − 0)/1 + qmin; x = 3.5 → −124.5 (int8) → −124, u = 4;
    // x = 2.5 → −125.5 → −126, u = 2; int4: x = 3.5 → −4.5 → −4, u = 4; int2 below.
    let cases = [
        (Bits::Int8, 3.5f32, 4u8),
        (Bits::Int8, 2.5, 2),
        (Bits::Int4, 3.5, 4),
        (Bits::Int4, 5.5, 6),
        // int2: x = 0.5 → −1.5 → −2, u = 0; x = 2.5 → 0.5 → 0, u = 2.
        (Bits::Int2, 0.5, 0),
        (Bits::Int2, 2.5, 2),
    ];
    for (bits, x, u) in cases {
        let mut bytes = [0u8; 1];
        q::quantize_channels(&[x], &[1.0], &[0.0], bits, &mut bytes);
        assert_eq!(q::get(&bytes, 0, bits), u, "engine {bits:?} x={x}");
        let a = Affine {
            scale: half::f16::from_f32(1.0),
            zero: half::f16::from_f32(0.0),
        };
        assert_eq!(
            a.quantize(x, rbits(bits)),
            u as i32 + bits.qmin(),
            "reference {bits:?} x={x}"
        );
    }
}

/// f16 edge cases of the parameters: the minimum scale survives as a subnormal; huge
/// ranges saturate instead of overflowing.
#[test]
fn f16_parameter_edges() {
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        let (s, z) = q::params(1e-7, 1e-7, bits);
        assert!(s.to_f32() > 0.0 && s.is_finite(), "min scale {s}");
        assert!((s.to_f32() - 1e-5).abs() < 2e-8, "min scale {s}");
        assert!(z.is_finite());
        let (s, z) = q::params(-65504.0, 65504.0, bits);
        assert!(s.is_finite() && z.is_finite(), "{s} {z}");
        assert_eq!(z.to_f32(), -65504.0);
        let (s, z) = q::params(-1e9, 1e9, bits);
        assert!(s.is_finite() && z.is_finite(), "saturated {s} {z}");
        let mut bytes = vec![0u8; bits.packed_len(2)];
        let (s, z) = q::quantize_token(&[-1e9, 1e9], bits, &mut bytes);
        let mut back = [0.0f32; 2];
        q::dequantize_token(&bytes, s, z, bits, &mut back);
        assert!(back.iter().all(|v| v.is_finite()), "{back:?}");
    }
}

fn config(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Config {
    Config {
        vocab_size: 16,
        hidden_size: n_heads * head_dim,
        n_layers: 1,
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate_size: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 4096,
        tie_word_embeddings: true,
        sliding_window: None,
        layer_types: vec![],
        num_kv_shared_layers: 0,
        attention_bias: false,
        qk_norm: false,
        gemma: Default::default(),
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// A failure class: how token `t`'s (q, k, v) are made.
#[derive(Debug, Clone, Copy)]
enum Class {
    /// Channel 1 of K is the same constant for every token (hi = lo).
    ConstantChannel,
    /// K is all zeros.
    ZeroK,
    /// K and V near ±65504 (f16 overflow of scale/zero).
    NearF16Max,
    /// K and V near 1e-7 (f16 scale underflow).
    Tiny,
}

fn token(
    class: Class,
    rng: &mut ChaCha8Rng,
    q_dim: usize,
    kv_dim: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let q: Vec<f32> = (0..q_dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let mut k: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let mut v: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    match class {
        Class::ConstantChannel => k[1] = 3.25,
        Class::ZeroK => k.iter_mut().for_each(|x| *x = 0.0),
        Class::NearF16Max => {
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = if *x >= 0.0 {
                    65504.0 - 10.0 * *x
                } else {
                    -65504.0 - 10.0 * *x
                };
            }
        }
        Class::Tiny => {
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = 1e-7 + 5e-8 * *x;
            }
        }
    }
    (q, k, v)
}

/// Pushes each failure class through engine and reference caches at T = 1 and around a
/// group boundary, for every precision: nothing becomes NaN/Inf, the dequantised rows
/// stay within the round-trip bound of the originals (computed over each channel's full
/// range, which contains every group's range), engine and reference agree bit for bit,
/// and where the class allows it the output is close to an fp32 cache's.
#[test]
fn failure_classes_stay_finite_and_close() {
    let (n_heads, kv_heads, hd, g) = (4usize, 2usize, 16usize, 8usize);
    let cfg = config(n_heads, kv_heads, hd);
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    let rope = Rope::new(&cfg);
    let table = RopeTable::new(&cfg);
    let first = 4; // full-precision rows before the first K group
    let lengths = [
        1,
        g - 1,
        g,
        g + 1,
        first + g - 1,
        first + g,
        first + g + 1,
        first + 3 * g + 1,
    ];
    for class in [
        Class::ConstantChannel,
        Class::ZeroK,
        Class::NearF16Max,
        Class::Tiny,
    ] {
        for &precision in &Precision::ALL {
            for positions in [PositionsMode::Original, PositionsMode::Cache] {
                for &steps in &lengths {
                    for window in [None, Some(5)] {
                        let kv = KvConfig {
                            precision,
                            group_size: g,
                            sink: if window.is_some() { 2 } else { 0 },
                            window,
                            positions,
                            // stored rows are compared with the raw K/V, so unrotated
                            rotation: KvRotation::None,
                            ..KvConfig::default()
                        };
                        let dense = KvConfig {
                            precision: Precision::Fp32,
                            ..kv.clone()
                        };
                        let ctx = format!(
                            "{class:?} {precision:?} {positions:?} T={steps} window={window:?}"
                        );
                        let mut rng = ChaCha8Rng::seed_from_u64(steps as u64);
                        let mut engine = LayerKv::new(&kv, kv_heads, hd);
                        let mut fp32 = LayerKv::new(&dense, kv_heads, hd);
                        let mut reference = LayerCache::new(&kv, kv_heads, hd);
                        let (mut se, mut sf) =
                            (AttnScratch::new(&cfg, &kv), AttnScratch::new(&cfg, &dense));
                        let (mut oe, mut of, mut or) =
                            (vec![0.0; q_dim], vec![0.0; q_dim], vec![0.0; q_dim]);
                        let mut raw: Vec<Vec<f32>> = Vec::new();
                        let mut raw_v: Vec<Vec<f32>> = Vec::new();
                        for pos in 0..steps {
                            let (qv, k, v) = token(class, &mut rng, q_dim, kv_dim);
                            let mut k_stored = k.clone();
                            if positions == PositionsMode::Original {
                                rope.rotate_heads(&mut k_stored, pos);
                            }
                            raw.push(k_stored);
                            raw_v.push(v.clone());
                            attend(
                                &cfg,
                                &table,
                                &mut engine,
                                &qv,
                                &k,
                                &v,
                                pos,
                                &mut oe,
                                &mut se,
                                None,
                            );
                            attend(
                                &cfg, &table, &mut fp32, &qv, &k, &v, pos, &mut of, &mut sf, None,
                            );
                            tinygpt_reference::attention::attend(
                                &cfg,
                                &rope,
                                &mut reference,
                                &qv,
                                &k,
                                &v,
                                pos,
                                &mut or,
                                None,
                            );
                            assert!(oe.iter().all(|x| x.is_finite()), "{ctx} pos={pos}: {oe:?}");
                            assert!(or.iter().all(|x| x.is_finite()), "{ctx} pos={pos}: {or:?}");
                        }
                        let positions_now = engine.positions();
                        for (i, &p) in positions_now.iter().enumerate() {
                            let (ke, ve) = (engine.key(i), engine.value(i));
                            assert_eq!(
                                ke.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                reference
                                    .key(i)
                                    .iter()
                                    .map(|x| x.to_bits())
                                    .collect::<Vec<_>>(),
                                "{ctx} key row {i}"
                            );
                            assert_eq!(
                                ve.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                reference
                                    .value(i)
                                    .iter()
                                    .map(|x| x.to_bits())
                                    .collect::<Vec<_>>(),
                                "{ctx} value row {i}"
                            );
                            for c in 0..kv_dim {
                                let (k_bound, v_bound) = match precision.kivi_bits() {
                                    Some(b) => {
                                        let ch: Vec<f32> = raw.iter().map(|row| row[c]).collect();
                                        let (lo, hi) = min_max(&ch);
                                        let head = c / hd;
                                        let vrow = &raw_v[p][head * hd..(head + 1) * hd];
                                        let (vlo, vhi) = min_max(vrow);
                                        // f16 rounding of a sub-range's scale/zero vs the full range's: a few 2^-11.
                                        let slack = |m: f32| m * 2f32.powi(-8) + 6e-8;
                                        (
                                            Affine::from_range(lo, hi, b).error_bound(lo, hi, b)
                                                + slack(lo.abs().max(hi.abs())),
                                            Affine::fit(vrow, b).error_bound(vlo, vhi, b),
                                        )
                                    }
                                    None => {
                                        // fp16/bf16 rounding: half an ulp of the format.
                                        let rel = if precision == Precision::Bf16 {
                                            2f32.powi(-8)
                                        } else {
                                            2f32.powi(-11)
                                        };
                                        (
                                            raw[p][c].abs() * rel + 6e-8,
                                            raw_v[p][c].abs() * rel + 6e-8,
                                        )
                                    }
                                };
                                // In `original` mode RoPE can rotate keys near ±65504 past
                                // f16's range; those saturate (documented), so the part of
                                // a value beyond ±65504 is allowed as extra error.
                                let k_bound = k_bound + (raw[p][c].abs() - 65504.0).max(0.0);
                                assert!(
                                    (ke[c] - raw[p][c]).abs() <= k_bound,
                                    "{ctx} row {i} K channel {c}: {} vs {} (bound {k_bound})",
                                    ke[c],
                                    raw[p][c]
                                );
                                assert!(
                                    (ve[c] - raw_v[p][c]).abs() <= v_bound,
                                    "{ctx} row {i} V channel {c}: {} vs {} (bound {v_bound})",
                                    ve[c],
                                    raw_v[p][c]
                                );
                            }
                        }
                        match class {
                            // Attention over ±65504 keys is a hard max: compare finiteness only.
                            Class::NearF16Max => {}
                            Class::Tiny => {
                                for (a, b) in oe.iter().zip(&of) {
                                    assert!(
                                        (a - b).abs() <= FP32_VS_KIVI_TINY,
                                        "{ctx}: {a} vs fp32 {b}"
                                    );
                                }
                            }
                            Class::ConstantChannel | Class::ZeroK => {
                                // Same quantisation error budget as any slice of this range.
                                for (a, b) in oe.iter().zip(&of) {
                                    assert!((a - b).abs() <= 0.25, "{ctx}: {a} vs fp32 {b}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// fp16 storage saturates just beyond f16's range instead of storing ±Inf.
#[test]
fn fp16_storage_saturates() {
    let kv = KvConfig {
        precision: Precision::Fp16,
        ..KvConfig::default()
    };
    let mut engine = LayerKv::new(&kv, 1, 4);
    let mut reference = LayerCache::new(&kv, 1, 4);
    let row = [70000.0f32, -1e9, 65504.0, 1.0];
    engine.append(&row, &row, 0);
    reference.append(&row, &row, 0);
    assert_eq!(engine.key(0), vec![65504.0, -65504.0, 65504.0, 1.0]);
    assert_eq!(reference.key(0), engine.key(0));
    assert_eq!(reference.value(0), engine.value(0));
}
