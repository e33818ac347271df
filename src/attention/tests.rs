//! Attention against its unfused twin (dequantise, then dot) and the reference, the split
//! path against whole heads, the block scorers and the softmax.

use super::*;
use crate::kv_cache::{KeyRope, KvConfig, KvRotation, Precision};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tinygpt_reference::kv_cache::LayerCache;

/// Fused attention vs the unfused (dequantise-then-dot) twin, and vs the reference:
/// max |a − b| over outputs and softmax weights, relative to the vector's largest
/// magnitude (at least 1). Folding the scales changes the summation order, so the
/// fused path and its unfused twin are not bit-equal; the observed worst case over the
/// sweep below is printed (about 2e-6 when written). The reference computes the
/// `portable` kernels' order (`tinygpt_reference::order`): under
/// `TINYGPT_KV_KERNEL=portable` it is bit-identical (checked below); the other KIVI
/// kernels add in other orders, hence the budget (same value as tests/kv_cache.rs's
/// `ENGINE_VS_REFERENCE`).
const FUSED_VS_UNFUSED: f32 = 1e-5;
const ENGINE_VS_REFERENCE: f32 = 3e-5;

fn test_config(n_heads: usize, n_kv_heads: usize, hd: usize, sliding: Option<usize>) -> Config {
    Config {
        vocab_size: 8,
        hidden_size: n_heads * hd,
        n_layers: 1,
        n_heads,
        n_kv_heads,
        head_dim: hd,
        intermediate_size: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: tinygpt_reference::RopeScaling::None,
        max_position_embeddings: 4096,
        tie_word_embeddings: true,
        sliding_window: sliding,
        layer_types: vec![],
        num_kv_shared_layers: 0,
        attention_bias: false,
        qk_norm: false,
        gemma: Default::default(),
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() / scale })
        .fold(0.0, f32::max)
}

/// One differential case; `Debug` prints every parameter on failure.
#[derive(Debug, Clone)]
struct Case {
    precision: Precision,
    /// V's precision when it differs from `precision`
    v_precision: Option<Precision>,
    residual: usize,
    key_rope: KeyRope,
    positions: PositionsMode,
    head_dim: usize,
    n_kv_heads: usize,
    /// query heads per KV head (GQA)
    group: usize,
    group_size: usize,
    sink: usize,
    window: Option<usize>,
    sliding_window: Option<usize>,
    steps: usize,
    seed: u64,
    rotation: KvRotation,
}

/// [`score_rows`] over random cuts of every KV head's rows (any length, not only the
/// team's multiples of 16), then [`mix_query_heads`] over random runs of each KV
/// head's query heads: the output and the weights, `(n_heads, stored)`, of a prepared
/// step.
fn split_attend(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv,
    tables: &StepTables,
    rng: &mut ChaCha8Rng,
) -> (Vec<f32>, Vec<f32>) {
    let (hd, group, n) = (cfg.head_dim, cfg.group(), layer.len());
    let mut probs = vec![f32::NAN; cfg.n_heads * n];
    let mut out = vec![f32::NAN; cfg.q_dim()];
    let mut hs = HeadScratch::default();
    for h in 0..cfg.n_kv_heads {
        let head = &mut probs[h * group * n..(h + 1) * group * n];
        let mut lo = 0;
        while lo < n {
            let hi = (lo + rng.gen_range(1..=9)).min(n);
            let len = hi - lo;
            let mut part = vec![0.0f32; group * len];
            score_rows(cfg, rope, layer, tables, h, lo..hi, &mut hs, &mut part, len);
            for j in 0..group {
                head[j * n + lo..j * n + hi].copy_from_slice(&part[j * len..(j + 1) * len]);
            }
            lo = hi;
        }
        let mut j = 0;
        while j < group {
            let k = rng.gen_range(1..=group - j);
            let (q0, q1) = (h * group + j, h * group + j + k);
            let o = &mut out[q0 * hd..q1 * hd];
            let p = &mut head[j * n..(j + k) * n];
            mix_query_heads(cfg, rope, layer, tables, h, p, o);
            j += k;
        }
    }
    (out, probs)
}

/// A decode team's split of a prepared step ([`SplitPlan`] for `members`): every scoring
/// unit into its block of the scores, then every mixing unit's scores gathered back and
/// mixed. The output and the weights, `(n_heads, stored)`.
fn plan_attend(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv,
    tables: &StepTables,
    members: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (hd, group, n) = (cfg.head_dim, cfg.group(), layer.len());
    let plan = SplitPlan::new(n, members, cfg.n_kv_heads, group);
    let mut scores = vec![f32::NAN; cfg.n_heads * n];
    let mut hs = HeadScratch::default();
    for u in 0..plan.score_units() {
        let (h, rows) = plan.score_unit(u);
        let len = rows.len();
        let block = &mut scores[plan.score_at(u)..plan.score_at(u + 1)];
        assert_eq!(block.len(), group * len);
        score_rows(cfg, rope, layer, tables, h, rows, &mut hs, block, len);
    }
    let (mut out, mut probs) = (vec![f32::NAN; cfg.q_dim()], vec![f32::NAN; cfg.n_heads * n]);
    let mut p = Vec::new();
    for u in 0..plan.mix_units() {
        let (h, js) = plan.mix_unit(u);
        let (q0, q1) = (plan.mix_head(u), plan.mix_head(u) + js.len());
        plan.gather(&scores, h, js, &mut p);
        mix_query_heads(
            cfg,
            rope,
            layer,
            tables,
            h,
            &mut p,
            &mut out[q0 * hd..q1 * hd],
        );
        probs[q0 * n..q1 * n].copy_from_slice(&p);
    }
    (out, probs)
}

/// A [`SplitPlan`]'s units cover every (KV head, row) and every query head once, in order:
/// scoring units of a multiple of 16 rows, each one's block right after the last, about
/// four per member; mixing units of consecutive query heads.
#[test]
fn split_plans_cover_every_row_and_query_head_once() {
    for n in [1usize, 2, 15, 16, 17, 100, 255, 256, 257, 1000, 4099] {
        for (members, nkv, group) in
            (1..=4).flat_map(|m| (1..=5).flat_map(move |k| (1..=9).map(move |g| (m, k, g))))
        {
            let plan = SplitPlan::new(n, members, nkv, group);
            let what = format!("n={n} members={members} kv heads={nkv} group={group}");
            assert!(plan.score_units() <= 4 * members + nkv, "{what}");
            let (mut rows_seen, mut at) = (vec![0u8; nkv * n], 0);
            for u in 0..plan.score_units() {
                let (h, rows) = plan.score_unit(u);
                assert!(!rows.is_empty() && rows.start % 16 == 0, "{what}: unit {u}");
                assert_eq!(plan.score_at(u), at, "{what}: unit {u}");
                at += group * rows.len();
                rows.for_each(|i| rows_seen[h * n + i] += 1);
            }
            assert_eq!(plan.score_at(plan.score_units()), at, "{what}");
            assert_eq!(at, nkv * group * n, "{what}");
            assert!(rows_seen.iter().all(|&s| s == 1), "{what}: rows");
            let mut next = 0;
            for u in 0..plan.mix_units() {
                let (h, js) = plan.mix_unit(u);
                assert!(!js.is_empty() && js.end <= group, "{what}: unit {u}");
                assert_eq!(plan.mix_head(u), h * group + js.start, "{what}: unit {u}");
                assert_eq!(plan.mix_head(u), next, "{what}: unit {u}");
                next += js.len();
            }
            assert_eq!(plan.mix_head(plan.mix_units()), nkv * group, "{what}");
            assert_eq!(next, nkv * group, "{what}");
        }
    }
}

/// Runs fused, unfused and reference side by side, comparing after every step (so
/// every T from 1 to `steps`: T = G − 1, G, G + 1 after the prefix, the window's
/// fill and every ring wrap are all visited). Returns the worst (fused vs unfused,
/// fused vs reference) errors.
fn run_case(c: &Case) -> (f32, f32) {
    let n_heads = c.n_kv_heads * c.group;
    let cfg = test_config(n_heads, c.n_kv_heads, c.head_dim, c.sliding_window);
    let kv = KvConfig {
        precision: c.precision,
        v_precision: c.v_precision,
        residual: c.residual,
        key_rope: c.key_rope,
        group_size: c.group_size,
        sink: c.sink,
        window: c.window,
        positions: c.positions,
        rotation: c.rotation,
        ..KvConfig::default()
    };
    crate::kv_cache::validate(&kv, &cfg).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let rope = RopeTable::new(&cfg);
    let ref_rope = tinygpt_reference::rope::Rope::new(&cfg);
    let mut layer = LayerKv::new(&kv, c.n_kv_heads, c.head_dim);
    let mut reference = LayerCache::new(&kv, c.n_kv_heads, c.head_dim);
    let mut scratch = AttnScratch::new(&cfg, &kv);
    // The portable KIVI kernels add in the reference's order: their output is checked bit
    // for bit against the reference below (the default scratch runs the fast kernels).
    let mut exact = AttnScratch::with_kernel(&cfg, &kv, crate::kivi::KvKernel::Portable);
    let (mut out_e, mut p_e) = (vec![0.0; cfg.q_dim()], Vec::new());
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let mut cuts = ChaCha8Rng::seed_from_u64(c.seed ^ 0x5eed);
    let kv_dim = cfg.kv_dim();
    // Per-channel K offsets and one outlier channel, as real K has.
    let mut k_bias: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
    k_bias[kv_dim / 3] = 12.0;
    let (mut out_f, mut out_u, mut out_r) = (
        vec![0.0; cfg.q_dim()],
        vec![0.0; cfg.q_dim()],
        vec![0.0; cfg.q_dim()],
    );
    let (mut p_f, mut p_u, mut p_r) = (Vec::new(), Vec::new(), Vec::new());
    let (mut worst_u, mut worst_r) = (0.0f32, 0.0f32);
    for pos in 0..c.steps {
        let q: Vec<f32> = (0..cfg.q_dim()).map(|_| rng.gen_range(-1.5..1.5)).collect();
        let k: Vec<f32> = k_bias
            .iter()
            .map(|b| b + rng.gen_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
        append_kv(&cfg, &rope, &mut layer, &k, &v, pos, scratch.split_mut().0);
        attend_stored(
            &cfg,
            &rope,
            &layer,
            &q,
            pos,
            &mut out_f,
            &mut scratch,
            Some(&mut p_f),
        );
        // The split path (a decode team's): scores in random row ranges, then each
        // query head alone — bit for bit the whole-head path.
        let (out_s, p_s) = split_attend(&cfg, &rope, &layer, scratch.split_mut().0, &mut cuts);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out_s), bits(&out_f), "{c:?} pos={pos}: split output");
        assert_eq!(bits(&p_s), bits(&p_f), "{c:?} pos={pos}: split weights");
        // The team's own cuts ([`SplitPlan`]) for 2 and 3 members.
        for members in [2, 3] {
            let tables = scratch.split_mut().0;
            let (out_p, p_p) = plan_attend(&cfg, &rope, &layer, tables, members);
            let what = format!("{c:?} pos={pos}: planned split for {members}");
            assert_eq!(bits(&out_p), bits(&out_f), "{what}: output");
            assert_eq!(bits(&p_p), bits(&p_f), "{what}: weights");
        }
        attend_stored_dequant(&cfg, &rope, &layer, &q, pos, &mut out_u, Some(&mut p_u));
        tinygpt_reference::attention::attend(
            &cfg,
            &ref_rope,
            &mut reference,
            &q,
            &k,
            &v,
            pos,
            &mut out_r,
            Some(&mut p_r),
        );
        assert_eq!(p_f.len(), n_heads * layer.len(), "{c:?} pos={pos}");
        assert!(
            out_f.iter().all(|x| x.is_finite()),
            "{c:?} pos={pos}: non-finite"
        );
        attend_stored(
            &cfg,
            &rope,
            &layer,
            &q,
            pos,
            &mut out_e,
            &mut exact,
            Some(&mut p_e),
        );
        assert_eq!(
            bits(&out_e),
            bits(&out_r),
            "{c:?} pos={pos}: portable output"
        );
        assert_eq!(bits(&p_e), bits(&p_r), "{c:?} pos={pos}: portable weights");
        if scratch.kv_kernel() == crate::kivi::KvKernel::Portable {
            assert_eq!(bits(&out_f), bits(&out_r), "{c:?} pos={pos}: output");
            assert_eq!(bits(&p_f), bits(&p_r), "{c:?} pos={pos}: weights");
        }
        let eu = max_rel_err(&out_f, &out_u).max(max_rel_err(&p_f, &p_u));
        let er = max_rel_err(&out_f, &out_r).max(max_rel_err(&p_f, &p_r));
        assert!(
            eu <= FUSED_VS_UNFUSED,
            "{c:?} pos={pos}: fused vs unfused {eu}"
        );
        assert!(
            er <= ENGINE_VS_REFERENCE,
            "{c:?} pos={pos}: fused vs reference {er}"
        );
        worst_u = worst_u.max(eu);
        worst_r = worst_r.max(er);
    }
    (worst_u, worst_r)
}

/// Every precision × positions mode × head dim (odd multiples of 2 and the
/// specialised 32/64) × GQA group, over shapes placed around group and window
/// boundaries.
#[test]
fn fused_matches_unfused_and_reference_on_sweep() {
    // (group_size, sink, window, sliding_window, steps)
    type Shape = (usize, usize, Option<usize>, Option<usize>, usize);
    let shapes: &[Shape] = &[
        (4, 0, None, None, 4 + 2 * 4 + 2), // T = 1 .. P + 2G + 2
        (3, 2, Some(5), None, 30),         // ring wraps mid-group
        (8, 0, Some(8), None, 30),         // window = G
        (32, 4, Some(40), None, 90),       // default G; long runs, 8-row blocks
        (4, 2, Some(9), Some(5), 24),      // Mistral sliding window
    ];
    let (mut worst_u, mut worst_r) = (0.0f32, 0.0f32);
    let mut seed = 7;
    // (K precision, V override, residual, key_rope): every precision, asymmetric pairs,
    // residuals and pre-RoPE keys.
    let mut sides: Vec<(Precision, Option<Precision>, usize, KeyRope)> = Precision::ALL
        .iter()
        .map(|&p| (p, None, 0, KeyRope::Post))
        .collect();
    sides.extend([
        (Precision::Int8, Some(Precision::Int4), 0, KeyRope::Post),
        (Precision::Int4, Some(Precision::Int2), 5, KeyRope::Post),
        (Precision::Fp16, Some(Precision::Int4), 3, KeyRope::Post),
        (Precision::Int2, None, 6, KeyRope::Pre),
        (Precision::Int4, None, 0, KeyRope::Pre),
        (Precision::Bf16, None, 0, KeyRope::Pre),
    ]);
    for (precision, v_precision, residual, key_rope) in sides {
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            for head_dim in [2usize, 6, 18, 32, 34, 64] {
                let int2 = [Some(precision), v_precision].contains(&Some(Precision::Int2));
                if int2 && head_dim % 4 != 0 {
                    continue;
                }
                for group in [1usize, 2, 3] {
                    for &(group_size, sink, window, sliding_window, steps) in shapes {
                        seed += 1;
                        let (u, r) = run_case(&Case {
                            precision,
                            v_precision,
                            residual,
                            key_rope,
                            positions,
                            head_dim,
                            n_kv_heads: 2,
                            group,
                            group_size,
                            sink,
                            window,
                            sliding_window,
                            steps,
                            seed,
                            // every other power-of-two case rotated (§2.5)
                            rotation: if head_dim.is_power_of_two() && seed % 2 == 0 {
                                KvRotation::Hadamard
                            } else {
                                KvRotation::None
                            },
                        });
                        worst_u = worst_u.max(u);
                        worst_r = worst_r.max(r);
                    }
                }
            }
        }
    }
    eprintln!("worst relative error: fused vs unfused {worst_u:e}, fused vs reference {worst_r:e}");
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (
            prop::sample::select(Precision::ALL.to_vec()),
            any::<bool>(),
            prop::sample::select(vec![2usize, 4, 6, 10, 16, 18, 32, 34, 48, 64, 66, 128]),
            1usize..4,
            1usize..4,
        ),
        (
            1usize..12,
            0usize..6,
            prop::option::of(1usize..14),
            prop::option::weighted(0.2, 1usize..8),
            1usize..45,
            any::<u64>(),
        ),
        (
            prop::option::weighted(0.3, prop::sample::select(Precision::ALL.to_vec())),
            prop::sample::select(vec![0usize, 0, 1, 2, 5, 9, 20]),
            any::<bool>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (precision, cache, head_dim, n_kv_heads, group),
                (g, sink, window, sliding, steps, seed),
                (v_precision, residual, pre, rot),
            )| Case {
                precision,
                v_precision,
                residual,
                key_rope: if pre { KeyRope::Pre } else { KeyRope::Post },
                positions: if cache {
                    PositionsMode::Cache
                } else {
                    PositionsMode::Original
                },
                // int2 needs head_dim a multiple of 4
                head_dim: if [Some(precision), v_precision].contains(&Some(Precision::Int2)) {
                    head_dim.div_ceil(4) * 4
                } else {
                    head_dim
                },
                n_kv_heads,
                group,
                group_size: g,
                sink: if window.is_some() { sink } else { 0 },
                window,
                sliding_window: sliding,
                steps,
                seed,
                rotation: if rot && head_dim.is_power_of_two() {
                    KvRotation::Hadamard
                } else {
                    KvRotation::None
                },
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    })]

    /// Random shapes, caches and GQA groups: fused = unfused = reference within budget.
    #[test]
    fn fused_matches_unfused_and_reference_on_random_cases(c in case_strategy()) {
        run_case(&c);
    }
}

/// The engine's vectorised softmax against the reference's scalar one: every weight
/// within 2e-6 relative (`wide`'s `exp` is within a few ulp of libm's), masked (−inf)
/// entries exactly 0, ties at ±0, spreads wide enough to underflow, lengths around
/// the 8-lane boundaries.
#[test]
fn softmax_matches_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 33, 100, 1000] {
        for case in 0..5 {
            let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-20.0..20.0)).collect();
            match case {
                1 => x.iter_mut().step_by(3).for_each(|v| *v = f32::NEG_INFINITY),
                2 => {
                    x.iter_mut().for_each(|v| *v = -v.abs());
                    x[n / 2] = -0.0;
                    x[n - 1] = 0.0;
                }
                3 => x.iter_mut().for_each(|v| *v *= 1e-3),
                4 => x.iter_mut().for_each(|v| *v *= 10.0),
                _ => {}
            }
            if x.iter().all(|v| *v == f32::NEG_INFINITY) {
                x[0] = 1.0;
            }
            let masked: Vec<bool> = x.iter().map(|v| *v == f32::NEG_INFINITY).collect();
            let (mut a, mut b) = (x.clone(), x);
            softmax(&mut a, crate::kivi::KvKernel::best(false));
            tinygpt_reference::attention::softmax(&mut b);
            for i in 0..n {
                if masked[i] {
                    assert_eq!(a[i], 0.0, "n={n} case={case} i={i}: masked entry");
                }
                let tol = 2e-6 * b[i] + 1e-37;
                assert!(
                    (a[i] - b[i]).abs() <= tol,
                    "n={n} case={case} i={i}: {} vs {}",
                    a[i],
                    b[i]
                );
            }
            let total: f32 = a.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "n={n} case={case}: sum {total}");
        }
    }
}

/// The block scorer against per-row dots, full and partial blocks, odd head dims.
#[test]
fn dot_block_matches_per_row_dots() {
    for hd in [2usize, 6, 8, 18, 32, 34, 64] {
        for m in 1..=BLOCK {
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
            let rows: Vec<f32> = (0..m * hd).map(|i| (i as f32 * 0.11).cos() * 4.0).collect();
            let mut out = vec![0.0f32; m];
            dot_block(&q, &rows, &mut out);
            for r in 0..m {
                let row = &rows[r * hd..(r + 1) * hd];
                let want: f64 = q.iter().zip(row).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = q
                    .iter()
                    .zip(row)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (out[r] as f64 - want).abs() <= 1e-6 * mag.max(1.0),
                    "hd={hd} m={m} r={r}: {} vs {want}",
                    out[r]
                );
            }
        }
    }
}

#[test]
fn rotate_dot_block_matches_rotate_then_dot() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for hd in [16usize, 32, 64, 96, 128, 256] {
        let half = hd / 2;
        for nq in 1..=9 {
            let stride = BLOCK + 3;
            let qs: Vec<f32> = (0..nq * hd).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut rows: Vec<f32> = (0..BLOCK * hd).map(|_| rng.gen_range(-8.0..8.0)).collect();
            // an extreme row and a constant one
            rows[..hd].fill(65504.0);
            rows[hd..2 * hd].fill(0.0);
            let angles: Vec<f32> = (0..BLOCK * half)
                .map(|_| rng.gen_range(-7.0..7.0))
                .collect();
            let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let mut full = vec![f32::NAN; nq * stride];
            rotate_dot_block(&qs, &rows, hd, (&cos, &sin), &mut full, stride);
            for (j, q) in qs.chunks_exact(hd).enumerate() {
                for r in 0..BLOCK {
                    let mut row = rows[r * hd..(r + 1) * hd].to_vec();
                    rotate_inline(
                        &mut row,
                        &cos[r * half..(r + 1) * half],
                        &sin[r * half..(r + 1) * half],
                    );
                    let want: f64 = q.iter().zip(&row).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = q
                        .iter()
                        .zip(&row)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    let got = full[j * stride + r];
                    assert!(
                        (got as f64 - want).abs() <= 1e-6 * mag.max(1.0),
                        "hd={hd} queries={nq} j={j} r={r}: {got} vs {want}"
                    );
                }
                assert!(full[j * stride + BLOCK..(j + 1) * stride]
                    .iter()
                    .all(|x| x.is_nan()));
            }
            // The same rows cut into smaller blocks score bit for bit the same.
            for m in 1..BLOCK {
                for r0 in (0..BLOCK).step_by(m) {
                    let k = m.min(BLOCK - r0);
                    let mut part = vec![0.0f32; nq * stride];
                    rotate_dot_block(
                        &qs,
                        &rows[r0 * hd..(r0 + k) * hd],
                        hd,
                        (&cos[r0 * half..], &sin[r0 * half..]),
                        &mut part,
                        stride,
                    );
                    for j in 0..nq {
                        for r in 0..k {
                            assert_eq!(
                                part[j * stride + r].to_bits(),
                                full[j * stride + r0 + r].to_bits(),
                                "hd={hd} queries={nq} block {m} row {}",
                                r0 + r
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rotate_matches_reference_bitwise() {
    for hd in [2usize, 6, 16, 32, 34, 64] {
        let cfg = Config {
            vocab_size: 8,
            hidden_size: hd,
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: hd,
            intermediate_size: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: tinygpt_reference::RopeScaling::None,
            max_position_embeddings: 128,
            tie_word_embeddings: true,
            sliding_window: None,
            layer_types: vec![],
            num_kv_shared_layers: 0,
            attention_bias: false,
            qk_norm: false,
            gemma: Default::default(),
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        let table = RopeTable::new(&cfg);
        let r = tinygpt_reference::rope::Rope::new(&cfg);
        for pos in [0usize, 1, 7, 1000, 123_456] {
            let x: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.7).sin()).collect();
            let (mut a, mut b) = (x.clone(), x);
            table.rotate_heads(&mut a, pos);
            r.rotate_heads(&mut b, pos);
            let (ab, bb): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|v| v.to_bits()).collect(),
                b.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(ab, bb, "hd={hd} pos={pos}");
        }
    }
}

/// The unfused twin of [`attend_stored`], as the engine did it before the fused kernels:
/// dequantise (and in `cache` mode rotate) every stored row of a KV head into an
/// `(stored, head_dim)` copy, then score, softmax and mix. Kept as the differential
/// oracle for the fused path.
#[allow(clippy::too_many_arguments)]
fn attend_stored_dequant(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv,
    q: &[f32],
    pos: usize,
    out: &mut [f32],
    probs_out: Option<&mut Vec<f32>>,
) {
    let hd = cfg.head_dim;
    let group = cfg.group();
    let mode = layer.config().positions;
    let n = layer.len();
    let mut qr = q.to_vec();
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    rope.rotate_heads(&mut qr, q_pos);
    let rotated = layer.config().rotates(hd);
    if rotated && !layer.config().keys_pre_rope() {
        hadamard::rotate_heads(&mut qr, hd);
    }
    let half = rope.half();
    let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
    let score_scale = cfg.score_scale();
    let (mut keys, mut values) = (vec![0.0; n * hd], vec![0.0; n * hd]);
    let mut all_probs = Vec::new();
    for h in 0..cfg.n_kv_heads {
        layer.gather_head(h, &mut keys, &mut values);
        if layer.config().keys_pre_rope() {
            for (i, key) in keys.chunks_exact_mut(hd).enumerate() {
                if rotated {
                    hadamard::rotate(key);
                }
                let at = match mode {
                    PositionsMode::Cache => i,
                    PositionsMode::Original => layer.position(i),
                };
                rope.cos_sin(at, &mut cos, &mut sin);
                rotate(key, &cos, &sin);
            }
        }
        for j in 0..group {
            let qh = &qr[(h * group + j) * hd..(h * group + j + 1) * hd];
            let mut scores: Vec<f32> = (0..n)
                .map(|i| match cfg.sliding_window {
                    Some(w) if pos.saturating_sub(layer.position(i)) >= w => f32::NEG_INFINITY,
                    _ => crate::ops::simd::dot(qh, &keys[i * hd..(i + 1) * hd]) * score_scale,
                })
                .collect();
            softmax(&mut scores, crate::kivi::KvKernel::best(false));
            let o = &mut out[(h * group + j) * hd..(h * group + j + 1) * hd];
            o.fill(0.0);
            for (&p, row) in scores.iter().zip(values.chunks_exact(hd)) {
                if p != 0.0 {
                    crate::ops::simd::axpy(p, row, o);
                }
            }
            if rotated {
                hadamard::rotate(o);
            }
            all_probs.extend_from_slice(&scores);
        }
    }
    if let Some(p) = probs_out {
        *p = all_probs;
    }
}
