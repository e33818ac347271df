//! The adaptive thread choice (`tinygpt_cpu::threads::Pace`): decode steps that switch
//! between the team and one thread give the same logits bit for bit as one thread all
//! along, and both modes really run. Its own test binary: the crowd check is process-wide.

mod common;
use common::*;
use tinygpt_cpu::exec::ExecOptions;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::threads;
use tinygpt_cpu::weights::ModelFiles;

const STEPS: usize = 70;

fn logits(
    model: &Model,
    kv: &KvConfig,
    threads: usize,
    feed: &[u32],
) -> (Vec<Vec<f32>>, (u64, u64)) {
    pool(threads).install(|| {
        let mut s = model.session(kv);
        let out = feed
            .iter()
            .enumerate()
            .map(|(pos, &t)| {
                model.forward(&mut s, t, pos).expect("forward");
                s.logits.clone()
            })
            .collect();
        (out, s.pace().runs())
    })
}

#[test]
fn switching_between_team_and_one_thread_changes_no_bit() {
    // Both modes must run here even if the machine is busy with other tests.
    threads::set_crowd_check(threads::CrowdCheck::Never);
    for dir in [None, Some(fixtures().join("yoco"))] {
        let files = ModelFiles::open(dir.as_deref()).expect("model");
        let opts = ExecOptions {
            adaptive: true,
            ..ExecOptions::default()
        };
        let model = Model::load_opts(&files, WeightsDType::Native, &opts).expect("load");
        let feed: Vec<u32> = (0..STEPS as u32)
            .map(|i| (i * 7 + 1) % model.cfg.vocab_size as u32)
            .collect();
        for kv in [KvConfig::default(), int4_window()] {
            let (one, _) = logits(&model, &kv, 1, &feed);
            let (two, (team_steps, solo_steps)) = logits(&model, &kv, 2, &feed);
            // Both modes ran (each at least twice, to be measured) and the
            // steps switched between them.
            assert!(
                team_steps >= 2 && solo_steps >= 2,
                "team {team_steps}, solo {solo_steps}"
            );
            assert_eq!(team_steps + solo_steps, STEPS as u64);
            for (pos, (a, b)) in one.iter().zip(&two).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{dir:?} {kv:?}: adaptive 2-thread step {pos} differs from 1 thread"
                );
            }
        }
    }
}
