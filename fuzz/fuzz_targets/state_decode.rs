//! `state::decode` of hostile bytes against the bundled model (fuzz/README.md). The first
//! input byte picks how the rest is read: bit 0 set, the header is rewritten for the body
//! that follows (`state::reseal`), so mutations reach the parser past the length and the
//! checksum; clear, the bytes are decoded as they are. The state is decoded with the cache
//! configuration it records (`state::peek_config`, else the default), so mutations of the
//! body reach the stores. A state that decodes must be usable: every stored row reads back
//! finite, and two decode steps run on it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tinygpt_cpu::config::Config;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::state::{self, ModelIdentity};
use tinygpt_cpu::weights::ModelFiles;

struct Bundled {
    cfg: Config,
    model: Model,
    id: ModelIdentity,
}

fn bundled() -> &'static Bundled {
    static B: OnceLock<Bundled> = OnceLock::new();
    B.get_or_init(|| {
        let files = ModelFiles::open(None).expect("bundled model");
        Bundled {
            cfg: files.config.clone(),
            model: Model::load(&files, WeightsDType::Native).expect("bundled model"),
            id: ModelIdentity::of(&files).expect("identity"),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 1 == 1 {
        state::reseal(&mut bytes);
    }
    let b = bundled();
    let kv = state::peek_config(&bytes).unwrap_or_else(|_| KvConfig::default());
    let Ok(st) = state::decode(&bytes, &b.id, &kv, &b.cfg) else {
        return;
    };
    for l in 0..st.cache.n_layers() {
        let layer = st.cache.layer(l);
        for i in 0..layer.len() {
            assert!(layer.key(i).iter().chain(&layer.value(i)).all(|x| x.is_finite()));
        }
    }
    // A step's scratch is sized by the cache's capacity: keep the run small.
    if kv.capacity().is_some_and(|c| c > 4096) {
        return;
    }
    let n = st.ids.len();
    let mut s = b.model.session(&kv);
    s.cache = st.cache;
    let _ = b.model.forward(&mut s, 3, n);
    let _ = b.model.forward(&mut s, 4, n + 1);
});
