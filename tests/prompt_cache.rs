//! The server's prompt cache (`tinygpt_cpu::server::prompt_cache`) at the library level:
//! a request resumed from a kept cache computes **the same bits** as one that recomputes
//! its whole prompt, for every cache mode, at every resume point of the kept entry (inside
//! the generated part, at window and KIVI-group boundaries), on the bundled model, the
//! YOCO fixture (shared and sliding layers), a tiny Gemma 3 (sliding layers of window 8),
//! and SmolLM2 / Gemma 3 270M when `TINYGPT_SMOLLM2` / `TINYGPT_GEMMA3` point at them;
//! and the cache's rules (which entry and point a prompt resumes from, what is no match,
//! the byte bound, the LRU order).
//!
//! The sequences run as the server's scheduler runs them (`run` below mirrors
//! `server/scheduler.rs`): the prompt in chunks through `Model::forward_sequences`, a hold
//! started at its end and bounded by `bound_hold` after every fed token, greedy tokens fed
//! back one by one, and the finished cache offered with `fed_ids`. The HTTP path on top
//! (the binary) is tested in tests/serve.rs.

mod common;
use common::*;
use std::path::PathBuf;
use tinygpt_cpu::kv_cache::{KvCache, KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{Model, SeqStep, Session, WeightsDType};
use tinygpt_cpu::server::prompt_cache::{
    bound_hold, entry_cost, fed_ids, Finished, PromptCache, Resume,
};
use tinygpt_cpu::server::worst_case_kv_bytes;
use tinygpt_cpu::weights::ModelFiles;

/// A limit no test entry reaches.
const ROOMY: usize = 1 << 40;
/// Prompt tokens per scheduler step (the server's `PREFILL_TOKENS_PER_STEP` is 64; a
/// smaller chunk makes the tiny prompts span several).
const CHUNK: usize = 8;

/// One sequence as the scheduler runs it with the prompt cache on.
struct Ran {
    /// logits[i] chose ids[i] (logits[0]: the prompt's last token's).
    logits: Vec<Vec<f32>>,
    ids: Vec<u32>,
    session: Session,
}

/// Prefills `prompt` (from `resume`'s point when given: its cache and reused count),
/// holds, then samples `n` greedy tokens, feeding back all but the last; `limit` bounds
/// the hold as `--prompt-cache-bytes` does.
fn run(
    model: &Model,
    kv: &KvConfig,
    prompt: &[u32],
    resume: Option<Resume>,
    n: usize,
    limit: usize,
) -> Ran {
    let mut session = model.session(kv);
    let mut done = 0;
    if let Some(r) = resume {
        session.cache = r.cache;
        done = r.reused;
    }
    while done < prompt.len() {
        let take = CHUNK.min(prompt.len() - done);
        let tokens = &prompt[done..done + take];
        model
            .forward_sequences(&mut [SeqStep {
                session: &mut session,
                tokens,
                start: done,
                all_logits: None,
            }])
            .unwrap();
        done += take;
    }
    session.cache.hold();
    bound_hold(&mut session.cache, limit);
    let mut logits = vec![session.logits.clone()];
    let mut ids = vec![argmax(&session.logits)];
    while ids.len() < n {
        let t = [*ids.last().unwrap()];
        let pos = prompt.len() + ids.len() - 1;
        model
            .forward_sequences(&mut [SeqStep {
                session: &mut session,
                tokens: &t,
                start: pos,
                all_logits: None,
            }])
            .unwrap();
        bound_hold(&mut session.cache, limit);
        logits.push(session.logits.clone());
        ids.push(argmax(&session.logits));
    }
    Ran {
        logits,
        ids,
        session,
    }
}

/// Offers a finished run to `pc` as the scheduler does.
fn offer(pc: &mut PromptCache, model: &Model, kv: &KvConfig, prompt: &[u32], ran: Ran) -> bool {
    let ids = fed_ids(prompt, &ran.ids, &ran.session.cache).expect("a finished sequence");
    assert_eq!(ids.len(), prompt.len() + ran.ids.len() - 1);
    pc.insert(Finished {
        kv: kv.clone(),
        worst_case: worst_case_kv_bytes(&model.cfg, kv, ids.len()),
        ids,
        cache: ran.session.cache,
        completion: "cmpl-test".into(),
    })
    .kept
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// One layer's appended count, positions, stored K and V rows (bits), bytes.
type LayerSnapshot = (usize, Vec<usize>, Vec<Vec<u32>>, usize);

/// Everything observable about a cache: per layer, appended count, positions, every
/// stored K and V row (as attention reads them), bytes.
fn snapshot(c: &KvCache) -> Vec<LayerSnapshot> {
    (0..c.n_layers())
        .map(|l| {
            let layer = c.layer(l);
            let rows = (0..layer.len())
                .flat_map(|i| [bits(&layer.key(i)), bits(&layer.value(i))])
                .collect();
            (layer.appended(), layer.positions(), rows, layer.bytes())
        })
        .collect()
}

/// Tokens that differ from `avoid` (so a prompt's match with a kept entry ends where the
/// test says), in the vocabulary.
fn suffix(len: usize, avoid: Option<u32>, vocab: usize) -> Vec<u32> {
    let mut t = 7u32;
    let mut out = Vec::new();
    while out.len() < len {
        t = (t * 31 + 11) % vocab as u32;
        if Some(t) != avoid && t > 2 {
            out.push(t);
        }
    }
    out
}

/// Sequence A (`prompt`, `gen` tokens) is kept; then for every resume point `r` of its
/// entry, request B = A's ids up to `r` + 3 other tokens resumes at exactly `r` and its
/// logits (prompt's last, then `n` greedy steps) and final cache equal B computed from
/// scratch, bit for bit. B = A's ids up to `r` exactly resumes at `r − 1` (one prompt
/// token must run), which is no match at `r` = the entry's start.
fn resume_equals_recompute(
    model: &Model,
    kv: &KvConfig,
    prompt: &[u32],
    gen: usize,
    n: usize,
    limit: usize,
) {
    let vocab = model.cfg.vocab_size;
    let mut pc = PromptCache::new(ROOMY);
    let a = run(model, kv, prompt, None, gen, limit);
    let mut a_ids = prompt.to_vec();
    a_ids.extend_from_slice(&a.ids[..gen - 1]);
    let from = a_ids.len() - a.session.cache.held().unwrap_or(0);
    assert!(
        offer(&mut pc, model, kv, prompt, a),
        "{kv:?}: the entry is kept"
    );
    assert_eq!(pc.len(), 1, "{kv:?}");
    for r in from..=a_ids.len() {
        let ctx = format!("{kv:?} r={r} (entry {from}..={})", a_ids.len());
        let mut b = a_ids[..r].to_vec();
        b.extend(suffix(3, a_ids.get(r).copied(), vocab));
        let hit = pc
            .lookup(kv, &b)
            .unwrap_or_else(|| panic!("{ctx}: no match"));
        assert_eq!(hit.reused, r, "{ctx}");
        let resumed = run(model, kv, &b, Some(hit), n, limit);
        let fresh = run(model, kv, &b, None, n, limit);
        assert_eq!(resumed.ids, fresh.ids, "{ctx}: ids");
        for (i, (x, y)) in resumed.logits.iter().zip(&fresh.logits).enumerate() {
            assert!(
                bits(x) == bits(y),
                "{ctx}: logits of step {i} differ in bits"
            );
        }
        assert!(
            snapshot(&resumed.session.cache) == snapshot(&fresh.session.cache),
            "{ctx}: final caches differ"
        );
        // The whole prompt matches: resumed one token earlier, if the entry reaches back.
        let whole = &a_ids[..r];
        match pc.lookup(kv, whole) {
            Some(hit) => {
                assert!(
                    r > from,
                    "{ctx}: whole-prompt match below the entry's start"
                );
                assert_eq!(hit.reused, r - 1, "{ctx}: whole prompt");
                let resumed = run(model, kv, whole, Some(hit), 2, limit);
                let fresh = run(model, kv, whole, None, 2, limit);
                assert!(
                    resumed
                        .logits
                        .iter()
                        .map(|l| bits(l))
                        .eq(fresh.logits.iter().map(|l| bits(l))),
                    "{ctx}: whole prompt, logits differ"
                );
            }
            None => assert_eq!(r, from, "{ctx}: whole-prompt match refused"),
        }
    }
    // Diverging inside A's prompt, or another cache configuration: no match.
    let mut early = prompt[..prompt.len() - 1].to_vec();
    early.extend(suffix(4, prompt.last().copied(), vocab));
    assert!(
        pc.lookup(kv, &early).is_none(),
        "{kv:?}: match inside the prompt"
    );
    let other = KvConfig {
        group_size: kv.group_size + 1,
        ..kv.clone()
    };
    let mut longer = a_ids.clone();
    longer.extend(suffix(3, None, vocab));
    assert!(
        pc.lookup(&other, &longer).is_none(),
        "{kv:?}: other config matched"
    );
    assert!(pc.lookup(kv, &longer).is_some(), "{kv:?}");
}

/// Every cache mode: each precision dense; int2 with a residual; K ≠ V; sink + window in
/// both positions modes over several precisions (the window of 20 evicts within A, and
/// KIVI groups of 8 complete inside A's generated part).
fn modes() -> Vec<KvConfig> {
    let base = |p: Precision| KvConfig {
        precision: p,
        group_size: 8,
        ..KvConfig::default()
    };
    let mut modes: Vec<KvConfig> = Precision::ALL.iter().map(|&p| base(p)).collect();
    modes.push(KvConfig {
        residual: 8,
        ..base(Precision::Int2)
    });
    modes.push(KvConfig {
        k_precision: Some(Precision::Int8),
        v_precision: Some(Precision::Int4),
        ..base(Precision::Int8)
    });
    for positions in [PositionsMode::Original, PositionsMode::Cache] {
        for kv in [
            base(Precision::Fp32),
            base(Precision::Fp16),
            base(Precision::Int4),
            KvConfig {
                residual: 4,
                ..base(Precision::Int2)
            },
            KvConfig {
                k_precision: Some(Precision::Int4),
                v_precision: Some(Precision::Int2),
                ..base(Precision::Int4)
            },
        ] {
            modes.push(KvConfig {
                sink: 4,
                window: Some(20),
                positions,
                ..kv
            });
        }
    }
    modes
}

fn load(dir: Option<PathBuf>) -> (ModelFiles, Model) {
    let files = ModelFiles::open(dir.as_deref()).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    (files, model)
}

#[test]
fn resume_equals_recompute_for_every_cache_mode() {
    let (files, model) = load(None);
    let prompt = files
        .tokenizer()
        .unwrap()
        .encode("import os\nimport sys\n")
        .unwrap();
    assert!(prompt.len() > CHUNK, "the prompt spans several chunks");
    let modes = modes();
    on_two_workers(&modes, |kv| {
        resume_equals_recompute(&model, kv, &prompt, 36, 8, ROOMY);
    });
}

/// YOCO: the upper layers read a lower layer's cache, the lower ones slide (window 64; a
/// StreamingLLM window of 20 bounds every layer tighter).
#[test]
fn resume_equals_recompute_with_shared_and_sliding_layers() {
    let (files, model) = load(Some(fixtures().join("yoco")));
    assert!(files.config.num_kv_shared_layers > 0);
    let prompt = files
        .tokenizer()
        .unwrap()
        .encode("def f(x):\n    return x")
        .unwrap();
    let modes: Vec<KvConfig> = modes()
        .into_iter()
        .filter(|kv| matches!(kv.precision, Precision::Fp32 | Precision::Int4))
        .collect();
    on_two_workers(&modes, |kv| {
        resume_equals_recompute(&model, kv, &prompt, 36, 8, ROOMY);
    });
}

/// Gemma 3 (tiny, random): both layers sliding with window 8, so A's generated part and B
/// evict from them at every step.
#[test]
fn resume_equals_recompute_with_gemma_sliding_layers() {
    let (files, model) = load(Some(fixtures().join("gemma3-softcap")));
    use tinygpt_cpu::config::AttentionType;
    let sliding = |c: &tinygpt_cpu::config::Config| {
        c.layer_types
            .iter()
            .filter_map(|t| match t {
                AttentionType::Sliding { window } => Some(*window),
                AttentionType::Full => None,
            })
            .max()
    };
    assert_eq!(sliding(&files.config), Some(8));
    let prompt: Vec<u32> = (0..11).map(|i| 5 + 37 * i % 2000).collect();
    let modes: Vec<KvConfig> = modes()
        .into_iter()
        .filter(|kv| {
            matches!(
                kv.precision,
                Precision::Fp32 | Precision::Int8 | Precision::Int4
            )
        })
        .collect();
    on_two_workers(&modes, |kv| {
        resume_equals_recompute(&model, kv, &prompt, 24, 6, ROOMY);
    });
}

/// A hold past its byte bound commits what it held and holds afresh: the entry then
/// resumes only from that later point, still bit for bit.
#[test]
fn a_bounded_hold_resumes_from_its_last_start() {
    let (files, model) = load(None);
    let prompt = files.tokenizer().unwrap().encode("The following").unwrap();
    let kv = KvConfig {
        precision: Precision::Int4,
        group_size: 8,
        sink: 4,
        window: Some(20),
        ..KvConfig::default()
    };
    // Room for the cache, its copy and 10 held rows.
    let mut probe = model.session(&kv);
    let row = {
        let t = [prompt[0]];
        probe.cache.hold();
        model
            .forward_sequences(&mut [SeqStep {
                session: &mut probe,
                tokens: &t,
                start: 0,
                all_logits: None,
            }])
            .unwrap();
        probe.cache.hold_bytes()
    };
    let full = worst_case_kv_bytes(&model.cfg, &kv, 1000);
    let limit = 2 * full + 10 * row;
    let a = run(&model, &kv, &prompt, None, 40, limit);
    let held = a.session.cache.held().expect("still holding");
    assert!(held < 39, "the hold was restarted ({held} held of 39)");
    resume_equals_recompute(&model, &kv, &prompt, 40, 6, limit);
    // A limit that cannot hold the copy: no hold, and the entry resumes at its end only.
    let tiny = run(&model, &kv, &prompt, None, 10, 1);
    assert_eq!(tiny.session.cache.held(), None);
    let mut pc = PromptCache::new(ROOMY);
    let ids = [&prompt[..], &tiny.ids[..9]].concat();
    offer(&mut pc, &model, &kv, &prompt, tiny);
    let mut b = ids[..ids.len() - 1].to_vec();
    b.extend(suffix(3, ids.last().copied(), model.cfg.vocab_size));
    assert!(
        pc.lookup(&kv, &b).is_none(),
        "resumed inside an unheld entry"
    );
    let b = [&ids[..], &[5, 6]].concat();
    assert_eq!(pc.lookup(&kv, &b).map(|r| r.reused), Some(ids.len()));
}

/// Which entry a prompt resumes from, the byte bound and the LRU order.
#[test]
fn lookup_rules_bound_and_lru() {
    let (files, model) = load(None);
    let kv = KvConfig::default();
    let p1 = files.tokenizer().unwrap().encode("import os").unwrap();
    let p2 = files.tokenizer().unwrap().encode("class Foo:").unwrap();
    let p3 = files.tokenizer().unwrap().encode("def main():").unwrap();
    let cost = |prompt: &[u32], gen: usize| {
        let a = run(&model, &kv, prompt, None, gen, ROOMY);
        let n = prompt.len() + gen - 1;
        // What an entry counts (docs/design.md §4, serve): the worst case or, if more,
        // what its buffers take, plus its hold and the rest of its heap blocks.
        let c = &a.session.cache;
        let ids = fed_ids(prompt, &a.ids, c).expect("a finished sequence");
        let cost = entry_cost(
            c,
            worst_case_kv_bytes(&model.cfg, &kv, n),
            &ids,
            "cmpl-test",
        );
        assert!(
            cost > worst_case_kv_bytes(&model.cfg, &kv, n).max(c.buffer_bytes()) + c.hold_bytes()
        );
        cost
    };
    let (c1, c2, c3) = (cost(&p1, 10), cost(&p2, 10), cost(&p3, 10));
    // Room for two of the three.
    let mut pc = PromptCache::new(c1 + c2 + c3 - c1.min(c2).min(c3) / 2);
    let a1 = run(&model, &kv, &p1, None, 10, ROOMY);
    let ids1 = [&p1[..], &a1.ids[..9]].concat();
    offer(&mut pc, &model, &kv, &p1, a1);
    offer(
        &mut pc,
        &model,
        &kv,
        &p2,
        run(&model, &kv, &p2, None, 10, ROOMY),
    );
    assert_eq!((pc.len(), pc.bytes()), (2, c1 + c2));
    // Using the first makes the second the least recently used one.
    let longer = [&ids1[..], &[5, 6, 7]].concat();
    assert_eq!(pc.lookup(&kv, &longer).map(|r| r.reused), Some(ids1.len()));
    offer(
        &mut pc,
        &model,
        &kv,
        &p3,
        run(&model, &kv, &p3, None, 10, ROOMY),
    );
    assert_eq!(pc.len(), 2);
    assert!(pc.bytes() <= pc.limit());
    assert!(pc.lookup(&kv, &longer).is_some(), "the used entry stays");
    let p2_longer = [&p2[..], &[5, 6, 7]].concat();
    assert!(pc.lookup(&kv, &p2_longer).is_none(), "the LRU entry left");
    // The same sequence again: the entry that offers every resume point stays alone.
    let again = run(&model, &kv, &p1, None, 10, ROOMY);
    assert!(
        offer(&mut pc, &model, &kv, &p1, again),
        "kept by the entry before"
    );
    assert_eq!(pc.len(), 2);
    // A longer run of the same prompt replaces the shorter one (it offers all its points).
    let c1_longer = cost(&p1, 14);
    assert!(
        c1_longer + c3 <= pc.limit(),
        "the test's limit fits the longer run"
    );
    let a1 = run(&model, &kv, &p1, None, 14, ROOMY);
    let ids1 = [&p1[..], &a1.ids[..13]].concat();
    offer(&mut pc, &model, &kv, &p1, a1);
    assert_eq!((pc.len(), pc.bytes()), (2, c1_longer + c3));
    let longer = [&ids1[..], &[5, 6, 7]].concat();
    assert_eq!(pc.lookup(&kv, &longer).map(|r| r.reused), Some(ids1.len()));
    // An entry larger than the whole limit is not kept.
    let mut small = PromptCache::new(c1 / 4);
    let a1 = run(&model, &kv, &p1, None, 10, ROOMY);
    assert!(!offer(&mut small, &model, &kv, &p1, a1));
    assert!(small.is_empty());
    // A limit of 0 keeps nothing.
    let mut off = PromptCache::new(0);
    offer(
        &mut off,
        &model,
        &kv,
        &p1,
        run(&model, &kv, &p1, None, 10, ROOMY),
    );
    assert!(off.is_empty());
}

/// SmolLM2 (skipped without it): the flagship's int4 sink + window cache and a dense one,
/// a chat-like prompt of ~100 tokens resumed at a few points.
#[test]
fn smollm2_resume_equals_recompute() {
    let Some(path) = smollm2_path() else {
        return;
    };
    let (files, model) = load(Some(path));
    let text = "The history of the city begins with a small settlement on the river, where \
                traders met to exchange grain, salt and cloth. Over the centuries it grew \
                into a market town, then a port, and finally the capital of the region.";
    let prompt = files.tokenizer().unwrap().encode(text).unwrap();
    for kv in [
        KvConfig::default(),
        KvConfig {
            precision: Precision::Int4,
            sink: 4,
            window: Some(48),
            ..KvConfig::default()
        },
    ] {
        resume_equals_recompute(&model, &kv, &prompt, 12, 4, ROOMY);
    }
}

/// Gemma 3 270M (skipped without it): sliding layers of window 512, crossed by A's
/// prompt; resumed at a few points inside the generated part.
#[test]
fn gemma3_270m_resume_equals_recompute() {
    let Some(path) = std::env::var_os("TINYGPT_GEMMA3").map(PathBuf::from) else {
        eprintln!("skipping: TINYGPT_GEMMA3 not set");
        return;
    };
    let (files, model) = load(Some(path));
    let window = files
        .config
        .layer_types
        .iter()
        .find_map(|t| match t {
            tinygpt_cpu::config::AttentionType::Sliding { window } => Some(*window),
            tinygpt_cpu::config::AttentionType::Full => None,
        })
        .expect("sliding layers");
    let text = "one two three four five six seven eight nine ten ".repeat(60);
    let mut prompt = files.tokenizer().unwrap().encode(&text).unwrap();
    prompt.truncate(window + 8);
    assert!(
        prompt.len() > window,
        "the prompt crosses the sliding window"
    );
    resume_equals_recompute(&model, &KvConfig::default(), &prompt, 5, 3, ROOMY);
}
