//! Saved cache states: one sequence's KV cache and the token ids whose rows it holds, as a
//! versioned, checksummed file (docs/design.md §5, "Saved states"), so a later run (or
//! request) resumes where this one stopped and prefills only what follows.
//!
//! * [`encode`] / [`save`] write a state: the [`ModelIdentity`] of the model that made
//!   it, the cache configuration (the user's, then each cache layer's), the ids (rows of
//!   positions `0..ids.len()` were appended, in order), optionally the logits after the
//!   last id ([`encode_with_logits`]), and the whole cache, every buffer as held
//!   (`kv_cache/state.rs`), so a loaded cache is **bit for bit** the saved one.
//! * [`decode`] / [`load`] refuse, with one line naming what differs ([`Problem`] says
//!   which check), a file that is not a state, another format version, a truncated or
//!   corrupted file (its length and CRC-32), another model, another cache configuration
//!   (the flag and both values), or contents that contradict the configuration (every
//!   declared length is checked against the bytes that remain and against what the
//!   configuration allows before anything is allocated). Never a partial load, never a
//!   panic.
//!
//! A state is never saved while the cache holds rows ([`KvCache::hold`], docs/design.md
//! §3.2): [`encode`] refuses ([`Problem::Busy`]); release them first, keeping the rows the
//! state should hold.

mod wire;

pub(crate) use wire::{Reader, Wire, Writer};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvConfig};
use crate::model::WeightsDType;
use crate::weights::ModelFiles;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The first eight bytes of every state file.
pub const MAGIC: [u8; 8] = *b"TGPTKVST";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Header bytes: magic, version, CRC-32 of the body, body length.
pub const HEADER_LEN: usize = 24;
/// What errors from [`decode`] name in place of a file ([`load`] names the file).
pub const UNNAMED: &str = "saved state";

/// Which check refused a state ([`Error::State`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// Not a state file (wrong magic).
    Magic,
    /// Another format version.
    Version,
    /// Shorter than its header says.
    Truncated,
    /// The body's CRC-32 differs: corrupted bytes.
    Checksum,
    /// Made by another model (or the same weights converted to another dtype).
    Model,
    /// Made with another cache configuration.
    Config,
    /// A field that cannot be read (a length past the end, an unknown code, a
    /// non-finite value).
    Malformed,
    /// Fields that contradict each other or the configuration.
    Inconsistent,
    /// The cache is holding rows ([`KvCache::hold`]): not saved.
    Busy,
    /// The state's ids are not a prefix of the prompt (`sample --load-state`).
    Prefix,
}

/// A refusal of a state not read from a file (see [`UNNAMED`]).
pub(crate) fn refuse(problem: Problem, msg: impl Into<String>) -> Error {
    Error::State {
        path: PathBuf::from(UNNAMED),
        problem,
        msg: msg.into(),
    }
}

/// Which model a state belongs to, cheap to compute at load: a 64-bit FNV-1a fingerprint
/// of the configuration's shape and numerics, every tensor's name, dtype, shape and byte
/// length, and four 64-byte samples of each tensor's bytes (its start, thirds and end:
/// about 256 bytes a tensor, never the whole file); the parameter count; and the weights
/// dtype the engine computes with. Two models compare equal when all three agree (`name`,
/// the model file's name, is for messages only).
#[derive(Clone, Debug)]
pub struct ModelIdentity {
    pub fingerprint: u64,
    pub parameters: u64,
    /// `--weights-dtype`: converted weights compute other bits.
    pub weights: WeightsDType,
    /// The model file's name, for messages.
    pub name: String,
}

impl PartialEq for ModelIdentity {
    fn eq(&self, o: &Self) -> bool {
        (self.fingerprint, self.parameters, self.weights)
            == (o.fingerprint, o.parameters, o.weights)
    }
}

/// 64-bit FNV-1a.
struct Fnv(u64);

impl Fnv {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn num(&mut self, x: u64) {
        self.bytes(&x.to_le_bytes())
    }
    fn text(&mut self, s: &str) {
        self.num(s.len() as u64);
        self.bytes(s.as_bytes());
    }
}

impl ModelIdentity {
    /// The identity of the model `files` holds, with `native` weights (see
    /// [`with_weights`](Self::with_weights)).
    pub fn of(files: &ModelFiles) -> Result<ModelIdentity> {
        let c = &files.config;
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        for x in [
            c.vocab_size,
            c.hidden_size,
            c.n_layers,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.max_position_embeddings,
            c.num_kv_shared_layers,
            c.sliding_window.map_or(0, |w| w + 1),
        ] {
            h.num(x as u64);
        }
        h.num(c.rms_norm_eps.to_bits() as u64);
        h.num(c.rope_theta.to_bits() as u64);
        h.text(&format!(
            "{:?} {:?} {:?} {} {} {}",
            c.rope_scaling,
            c.layer_types,
            c.gemma,
            c.tie_word_embeddings,
            c.attention_bias,
            c.qk_norm
        ));
        for (name, t) in &files.tensors {
            h.text(name);
            h.text(&t.dtype.to_string());
            h.num(t.shape.len() as u64);
            t.shape.iter().for_each(|&d| h.num(d as u64));
            let b = t.data.bytes();
            h.num(b.len() as u64);
            let n = b.len();
            for at in [0, n / 3, 2 * n / 3, n.saturating_sub(64)] {
                h.bytes(&b[at.min(n)..(at + 64).min(n)]);
            }
        }
        let name = files.path.file_name().map_or_else(
            || files.path.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        Ok(ModelIdentity {
            fingerprint: h.0,
            parameters: files.parameter_count() as u64,
            weights: WeightsDType::Native,
            name,
        })
    }

    /// This identity for an engine computing with `weights` (`--weights-dtype`).
    pub fn with_weights(mut self, weights: WeightsDType) -> Self {
        self.weights = weights;
        self
    }
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} parameters, {} weights, fingerprint {:016x})",
            self.name,
            self.parameters,
            self.weights.name(),
            self.fingerprint
        )
    }
}

/// A decoded state: the ids whose rows the cache holds (positions `0..ids.len()`), the
/// cache, and the logits after the last id when the state recorded them.
#[derive(Debug, Clone)]
pub struct SavedState {
    pub ids: Vec<u32>,
    pub cache: KvCache,
    pub logits: Option<Vec<f32>>,
}

mod config;
use config::KvRecord;

/// Encodes a state without logits (see [`encode_with_logits`]).
pub fn encode(id: &ModelIdentity, kv: &KvConfig, ids: &[u32], cache: &KvCache) -> Result<Vec<u8>> {
    encode_with_logits(id, kv, ids, cache, None)
}

/// Encodes the state of a cache built with `kv` ([`crate::model::new_cache`]) that has
/// appended the rows of `ids` (every layer `ids.len()` rows), and, if given, the logits
/// after the last id (`vocab_size` values: what a resume whose prompt is exactly `ids`
/// samples from). Refuses a
/// cache that is holding rows ([`Problem::Busy`]), one built with another `kv` or whose
/// layers appended another count than `ids.len()`, and non-finite logits.
pub fn encode_with_logits(
    id: &ModelIdentity,
    kv: &KvConfig,
    ids: &[u32],
    cache: &KvCache,
    logits: Option<&[f32]>,
) -> Result<Vec<u8>> {
    if cache.holding() {
        return Err(refuse(
            Problem::Busy,
            "the cache is holding rows (KvCache::hold): release them before saving its state",
        ));
    }
    if cache.config() != kv {
        return Err(refuse(
            Problem::Config,
            "the cache was built with another configuration",
        ));
    }
    if let Some(l) = (0..cache.n_layers()).find(|&l| cache.layer(l).appended() != ids.len()) {
        return Err(refuse(
            Problem::Inconsistent,
            format!(
                "layer {l} appended {} rows, not the {} ids given",
                cache.layer(l).appended(),
                ids.len()
            ),
        ));
    }
    if logits.is_some_and(|v| v.iter().any(|x| !x.is_finite())) {
        return Err(refuse(
            Problem::Malformed,
            "the logits hold a non-finite value",
        ));
    }
    if logits.is_some() && ids.is_empty() {
        return Err(refuse(Problem::Inconsistent, "logits after no token"));
    }
    let head_dim = match cache.n_layers() {
        0 => 0,
        _ => cache.layer(0).head_dim(),
    };
    let mut w = Writer::default();
    w.buf.resize(HEADER_LEN, 0);
    w.put(id.fingerprint);
    w.put(id.parameters);
    w.put(config::weights_code(id.weights));
    w.vec(id.name.as_bytes());
    KvRecord::of(kv, head_dim).write(&mut w);
    w.put(cache.n_layers() as u32);
    for l in 0..cache.n_layers() {
        let layer = cache.layer(l);
        KvRecord::of(layer.config(), layer.head_dim()).write(&mut w);
    }
    w.vec(ids);
    match logits {
        Some(v) => {
            w.put(1u8);
            w.vec(v);
        }
        None => w.put(0u8),
    }
    cache.save_state(&mut w);
    let mut buf = w.buf;
    reseal(&mut buf);
    Ok(buf)
}

/// Rewrites the header of `bytes` (a state's, at least [`HEADER_LEN`] long) for the body
/// that follows it: magic, version, CRC-32 and length. [`encode_with_logits`] ends with
/// it; tests and the fuzz target use it to make edited bodies pass the checksum.
#[doc(hidden)]
pub fn reseal(bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN {
        return;
    }
    let crc = crc32fast::hash(&bytes[HEADER_LEN..]);
    let len = (bytes.len() - HEADER_LEN) as u64;
    bytes[..8].copy_from_slice(&MAGIC);
    bytes[8..12].copy_from_slice(&VERSION.to_le_bytes());
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes[16..24].copy_from_slice(&len.to_le_bytes());
}

/// Checks the header (magic, version, length, CRC-32) and returns the body.
fn body(bytes: &[u8]) -> Result<&[u8]> {
    if bytes.len() < 8 || bytes[..8] != MAGIC {
        return Err(refuse(
            Problem::Magic,
            "not a tinygpt-cpu saved state (it does not start with TGPTKVST)",
        ));
    }
    if bytes.len() < HEADER_LEN {
        return Err(refuse(
            Problem::Truncated,
            format!(
                "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ),
        ));
    }
    let word = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let version = word(8);
    if version != VERSION {
        return Err(refuse(
            Problem::Version,
            format!("format version {version}; this build reads version {VERSION}"),
        ));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[16..24]);
    let len = u64::from_le_bytes(len);
    let body = &bytes[HEADER_LEN..];
    if (body.len() as u64) < len {
        return Err(refuse(
            Problem::Truncated,
            format!(
                "truncated: the header promises {len} bytes after it, {} follow",
                body.len()
            ),
        ));
    }
    if body.len() as u64 > len {
        return Err(refuse(
            Problem::Malformed,
            format!(
                "{} bytes follow the {len} the header promises",
                body.len() as u64 - len
            ),
        ));
    }
    let (stored, computed) = (word(12), crc32fast::hash(body));
    if stored != computed {
        return Err(refuse(
            Problem::Checksum,
            format!(
                "checksum mismatch (CRC-32 {stored:08x} recorded, {computed:08x} computed): the file is corrupted"
            ),
        ));
    }
    Ok(body)
}

/// Reads the identity section and refuses another model's.
fn check_identity(r: &mut Reader<'_>, id: &ModelIdentity) -> Result<()> {
    let what = |s: &'static str| move || format!("the model identity's {s}");
    let fingerprint = r.get::<u64>(&what("fingerprint"))?;
    let parameters = r.get::<u64>(&what("parameter count"))?;
    let weights = config::weights_of(r.get::<u8>(&what("weights dtype"))?)?;
    let name = r.vec::<u8>(4096, &what("name"))?;
    let theirs = ModelIdentity {
        fingerprint,
        parameters,
        weights,
        name: String::from_utf8_lossy(&name).into_owned(),
    };
    if theirs != *id {
        return Err(refuse(
            Problem::Model,
            format!("saved by another model: {theirs}; this run uses {id}"),
        ));
    }
    Ok(())
}

/// Decodes a state made by the model `id` with the cache configuration `kv` (checked
/// against `cfg`, the model's configuration), refusing anything else (see the module
/// docs). Errors name [`UNNAMED`] for the file.
pub fn decode(bytes: &[u8], id: &ModelIdentity, kv: &KvConfig, cfg: &Config) -> Result<SavedState> {
    let mut r = Reader::new(body(bytes)?);
    check_identity(&mut r, id)?;
    crate::kv_cache::validate(kv, cfg)?;
    KvRecord::read(&mut r, "the cache configuration")?
        .check(&KvRecord::of(kv, cfg.head_dim), "")?;
    let layers = cfg.layers_with_kv();
    let n = r.get::<u32>(&|| "the cache layer count".into())? as usize;
    if n != layers {
        return Err(refuse(
            Problem::Inconsistent,
            format!("the state has {n} cache layers, this model's cache has {layers}"),
        ));
    }
    for l in 0..layers {
        let want = KvRecord::of(&cfg.layer_kv_config(l, kv), cfg.head_dim);
        KvRecord::read(&mut r, &format!("layer {l}'s cache configuration"))?
            .check(&want, &format!("layer {l}: "))?;
    }
    let ids = r.vec::<u32>(r.remaining() / 4, &|| "the token ids".into())?;
    if let Some(i) = ids.iter().position(|&t| t as usize >= cfg.vocab_size) {
        return Err(refuse(
            Problem::Inconsistent,
            format!(
                "token id {} (index {i}) is outside the vocabulary ({})",
                ids[i], cfg.vocab_size
            ),
        ));
    }
    let logits = match r.get::<u8>(&|| "the logits flag".into())? {
        0 => None,
        1 => {
            let v = r.vec::<f32>(cfg.vocab_size, &|| "the logits".into())?;
            if v.len() != cfg.vocab_size || ids.is_empty() {
                return Err(refuse(
                    Problem::Inconsistent,
                    format!(
                        "{} logits after {} ids: a vocabulary of {} needs {} after at least one id",
                        v.len(),
                        ids.len(),
                        cfg.vocab_size,
                        cfg.vocab_size
                    ),
                ));
            }
            Some(v)
        }
        x => {
            return Err(refuse(
                Problem::Malformed,
                format!("the logits flag is {x}, not 0 or 1"),
            ))
        }
    };
    let mut cache = crate::model::new_cache(cfg, kv);
    cache.load_state(&mut r, ids.len())?;
    r.finish()?;
    Ok(SavedState { ids, cache, logits })
}

/// The cache configuration a state records (its header and checksum checked), without
/// checking the model: what a caller (the fuzz target) decodes the state with.
#[doc(hidden)]
pub fn peek_config(bytes: &[u8]) -> Result<KvConfig> {
    let mut r = Reader::new(body(bytes)?);
    check_identity(
        &mut r,
        &ModelIdentity {
            fingerprint: 0,
            parameters: 0,
            weights: WeightsDType::Native,
            name: String::new(),
        },
    )
    .or_else(|e| match e {
        Error::State {
            problem: Problem::Model,
            ..
        } => Ok(()),
        e => Err(e),
    })?;
    Ok(KvRecord::read(&mut r, "the cache configuration")?.config())
}

/// Refuses resuming a state whose ids are not a prefix of `prompt` (the rows of a cache
/// are those of its ids, in order: a prompt that differs anywhere before the state's end
/// cannot reuse it), naming the first token where they differ.
pub fn check_prefix(state: &[u32], prompt: &[u32]) -> Result<()> {
    let same = state.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    if same == state.len() {
        return Ok(());
    }
    Err(refuse(
        Problem::Prefix,
        match prompt.get(same) {
            Some(p) => format!(
                "the state's tokens differ from the prompt's at token {same} (id {} in the state, {p} in the prompt): it cannot be resumed with this prompt",
                state[same]
            ),
            None => format!(
                "the state holds {} tokens, more than the prompt's {} (they agree on all {same}): it cannot be resumed with this prompt",
                state.len(),
                prompt.len()
            ),
        },
    ))
}

/// The state's error naming `path` instead of [`UNNAMED`].
fn at_path(e: Error, path: &Path) -> Error {
    match e {
        Error::State { problem, msg, .. } => Error::State {
            path: path.to_path_buf(),
            problem,
            msg,
        },
        e => e,
    }
}

/// [`encode`] into the file `path`: written to a temporary file beside it, then renamed
/// over it, so `path` never holds a partial state.
pub fn save(
    path: &Path,
    id: &ModelIdentity,
    kv: &KvConfig,
    ids: &[u32],
    cache: &KvCache,
) -> Result<()> {
    save_with_logits(path, id, kv, ids, cache, None)
}

/// [`encode_with_logits`] into the file `path` (see [`save`]).
pub fn save_with_logits(
    path: &Path,
    id: &ModelIdentity,
    kv: &KvConfig,
    ids: &[u32],
    cache: &KvCache,
    logits: Option<&[f32]>,
) -> Result<()> {
    let bytes = encode_with_logits(id, kv, ids, cache, logits).map_err(|e| at_path(e, path))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// [`check_prefix`] for the state of the file `path` (errors name it).
pub fn check_prefix_of(path: &Path, state: &[u32], prompt: &[u32]) -> Result<()> {
    check_prefix(state, prompt).map_err(|e| at_path(e, path))
}

/// [`decode`] of the file `path` (errors name it).
pub fn load(path: &Path, id: &ModelIdentity, kv: &KvConfig, cfg: &Config) -> Result<SavedState> {
    crate::weights::regular_file(path)?;
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    decode(&bytes, id, kv, cfg).map_err(|e| at_path(e, path))
}
