//! Model files → named tensors, memory-mapped where possible.
//!
//! A [`ModelFiles`] is what opening `MODEL` yields, whatever its format (docs/design.md §5):
//! the validated config, every tensor under its Hugging Face name with its file dtype and
//! row-major shape, the tokenizer, and the chat template if the model has one. Tensor
//! bytes point into a shared backing buffer — an mmap of the file, the bundled model
//! compiled into the binary, or an owned buffer for tensors that had to be rewritten
//! (dtype conversion, GGUF row un-permutation) — so f32 weights are never copied at load.

use crate::config::{Config, HfConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tokenizer::{PendingTokenizer, Tokenizer};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod tensors;
pub use tensors::{LayerTensors, ModelTensors};

/// Metadata key of a `.tinygpt` file holding the config.json text.
pub const META_CONFIG: &str = "tinygpt.config";
/// Metadata key of a `.tinygpt` file holding the tokenizer.json text.
pub const META_TOKENIZER: &str = "tinygpt.tokenizer";
/// Optional metadata key holding a Jinja chat template.
pub const META_CHAT_TEMPLATE: &str = "tinygpt.chat_template";

/// The bytes behind tensors.
pub enum Backing {
    /// A memory-mapped file.
    Mmap(memmap2::Mmap),
    /// Bytes compiled into the binary (the bundled default model).
    Static(&'static [u8]),
    /// An owned buffer of SIMD vectors, so rows start on a vector boundary (no load
    /// straddles two cache lines). `.1` is the byte length.
    Owned(Vec<wide::f32x8>, usize),
    /// A GGUF file (itself an mmap), shared by the tensors that borrow from it.
    Gguf(Arc<crate::gguf::GgufFile>),
}

impl Backing {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Static(s) => s,
            Backing::Owned(v, n) => &bytemuck::cast_slice(v.as_slice())[..*n],
            Backing::Gguf(g) => g.bytes(),
        }
    }

    /// Copies `bytes` into a vector-aligned owned buffer.
    pub fn owned(bytes: &[u8]) -> Backing {
        let mut words = vec![wide::f32x8::ZERO; bytes.len().div_ceil(32)];
        bytemuck::cast_slice_mut::<wide::f32x8, u8>(&mut words)[..bytes.len()]
            .copy_from_slice(bytes);
        Backing::Owned(words, bytes.len())
    }

    /// Memory-maps `path` read-only.
    pub fn mmap(path: &Path) -> Result<Backing> {
        regular_file(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and private to this process. Another process
        // truncating or rewriting the model file while we run is outside our control
        // (as for every mmap-based loader: llama.cpp, candle, safetensors); we never
        // write through it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(Backing::Mmap(map))
    }
}

/// A byte range of a shared [`Backing`].
#[derive(Clone)]
pub struct TensorBytes {
    backing: Arc<Backing>,
    start: usize,
    len: usize,
}

impl TensorBytes {
    pub fn new(backing: Arc<Backing>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= backing.bytes().len());
        TensorBytes {
            backing,
            start,
            len,
        }
    }
    pub fn owned(bytes: &[u8]) -> Self {
        let len = bytes.len();
        TensorBytes::new(Arc::new(Backing::owned(bytes)), 0, len)
    }
    pub fn bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.start..self.start + self.len]
    }
    /// True when the bytes live in an mmap or in the binary (not copied at load).
    pub fn is_mapped(&self) -> bool {
        !matches!(*self.backing, Backing::Owned(..))
    }

    /// Drops the resident pages of `self.bytes()[range]` where they are a file mapping
    /// ([`crate::gguf::GgufFile::release`]); the bytes read the same afterwards. For bytes
    /// that are read once at load (checked, or repacked into an owned copy): they would
    /// otherwise stay resident beside the copy.
    pub fn release(&self, range: std::ops::Range<usize>) {
        debug_assert!(range.end <= self.len);
        let (start, len) = (self.start + range.start, range.len());
        match &*self.backing {
            Backing::Mmap(m) => crate::gguf::release_mapped(m, start, len),
            Backing::Gguf(g) => g.release(start, len),
            Backing::Static(_) | Backing::Owned(..) => {}
        }
    }
}

/// One named tensor as stored in the model file.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    /// Row-major shape, Hugging Face order (`(out_features, in_features)` for matrices).
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {} {:?})", self.name, self.dtype, self.shape)
    }
}

impl Tensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Dequantises/converts the whole tensor to f32 ([`crate::wkernels::dequant`]; used at load and
    /// to build the reference model).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.numel()];
        crate::wkernels::dequantize_into(self.dtype, self.data.bytes(), &mut out);
        out
    }

    /// This tensor converted to `dtype` (F32 or BF16), in an owned buffer.
    pub fn converted(&self, dtype: DType) -> Tensor {
        if dtype == self.dtype {
            return self.clone();
        }
        let f = self.to_f32();
        let bytes: Vec<u8> = match dtype {
            DType::F32 => bytemuck::cast_slice(&f).to_vec(),
            DType::BF16 => {
                let v: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
                bytemuck::cast_slice(&v).to_vec()
            }
            DType::F16 => {
                let v: Vec<f16> = f.iter().map(|&x| f16::from_f32(x)).collect();
                bytemuck::cast_slice(&v).to_vec()
            }
            other => unreachable!("conversion to {other} is not offered"),
        };
        Tensor {
            name: self.name.clone(),
            dtype,
            shape: self.shape.clone(),
            data: TensorBytes::owned(&bytes),
        }
    }
}

/// Which kind of file `MODEL` was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    HfDir,
    Tinygpt,
    Gguf,
    Bundled,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::HfDir => "Hugging Face directory",
            Format::Tinygpt => ".tinygpt",
            Format::Gguf => "GGUF",
            Format::Bundled => "bundled .tinygpt",
        }
    }
}

/// Everything read from a model file or directory.
pub struct ModelFiles {
    /// The path given by the user (or `<bundled>`), for messages.
    pub path: PathBuf,
    pub format: Format,
    pub config: Config,
    /// The config.json text (HF/.tinygpt); `None` for GGUF.
    pub config_json: Option<String>,
    pub tensors: BTreeMap<String, Tensor>,
    /// Built on its own thread from the moment the file is opened ([`Self::tokenizer`]).
    tokenizer: PendingTokenizer,
    /// The tokenizer.json text, when the model has one (HF/.tinygpt).
    pub tokenizer_json: Option<String>,
    pub chat_template: Option<String>,
    /// Bytes of the model file(s) on disk.
    pub file_bytes: u64,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The bundled default model: a `.tinygpt` compiled into the binary, 64-byte aligned.
/// Its header is padded so the data section starts on a 64-byte boundary (see
/// `fixtures/make_fixtures.py`), so every weight row starts on a cache line.
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);
static BUNDLED: &Aligned<[u8]> = &Aligned(*include_bytes!("../../fixtures/tiny.tinygpt"));

/// Path shown for the bundled model.
pub const BUNDLED_NAME: &str = "<bundled tiny model>";

impl ModelFiles {
    /// Opens `MODEL`: a Hugging Face directory, a `.gguf`, a `.tinygpt`, or (None) the
    /// bundled default model. The config is checked against the tensors (every tensor the
    /// forward pass needs, with its shape) and every weight against NaN/Inf before anything
    /// is allocated from the config's sizes.
    ///
    /// The tokenizer is built on a thread of its own meanwhile, and may still be when this
    /// returns (so that it overlaps the weights' checks and the loader's repack):
    /// [`tokenizer`](Self::tokenizer) waits for it and gives its error, if any. When a check
    /// of the weights fails too, the tokenizer's error is the one returned, as when the
    /// tokenizer was built first.
    pub fn open(path: Option<&Path>) -> Result<ModelFiles> {
        Self::open_unchecked(path)?.checked()
    }

    /// Reads a `.tinygpt` (safetensors with the config and tokenizer in its metadata) from
    /// bytes in memory, with the same checks as [`open`](Self::open) (tests, fuzzing).
    pub fn from_tinygpt_bytes(bytes: &[u8], path: &Path) -> Result<ModelFiles> {
        Self::from_tinygpt_backing(Arc::new(Backing::owned(bytes)), path, Format::Tinygpt)?
            .checked()
    }

    /// The model's tokenizer, waiting for its build the first time; the build's error
    /// (naming the file) if the tokenizer the file describes cannot be built or does not
    /// fit the model.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.get()
    }

    /// `self` once the weights pass [`check_layer_count`](Self::check_layer_count),
    /// [`ModelTensors::collect`] and [`check_finite`](Self::check_finite).
    fn checked(self) -> Result<ModelFiles> {
        let checks = self
            .check_layer_count()
            .and_then(|()| ModelTensors::collect(&self).map(drop))
            .and_then(|()| self.check_finite());
        match checks {
            Ok(()) => Ok(self),
            Err(e) => Err(self.tokenizer_error_or(e)),
        }
    }

    /// The tokenizer's error if its build failed, else `e`: a file refused for two reasons
    /// (its tokenizer, and `e` found while the tokenizer was being built) names the
    /// tokenizer's, as when the tokenizer was built before anything else was checked.
    pub fn tokenizer_error_or(&self, e: Error) -> Error {
        self.tokenizer.error_or(e)
    }

    /// The file that holds the config, for messages.
    fn config_path(&self) -> PathBuf {
        match self.format {
            Format::HfDir => self.path.join("config.json"),
            _ => self.path.clone(),
        }
    }

    /// Refuses a config that promises more layers than the weights hold, before a vector
    /// of `num_hidden_layers` anything is allocated.
    fn check_layer_count(&self) -> Result<()> {
        let held = self
            .tensors
            .keys()
            .filter_map(|n| {
                n.strip_prefix("model.layers.")?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .map_or(0, |m| m + 1);
        if self.config.n_layers > held {
            return Err(Error::config(
                self.config_path(),
                format!(
                    "num_hidden_layers is {} but the weights hold {held} layer(s)",
                    self.config.n_layers
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a weight holding NaN or Inf (for block-quantised tensors: a non-finite scale
    /// or minimum), naming the tensor. One pass over the weights, in parallel.
    pub fn check_finite(&self) -> Result<()> {
        use rayon::prelude::*;
        let tensors: Vec<&Tensor> = self.tensors.values().collect();
        let bad = tensors.par_iter().find_map_first(|t| {
            // A stretch of whole blocks at a time, each released once read: the
            // loader's repack (or a product) reads them again, so they need not stay
            // resident meanwhile.
            let bytes = t.data.bytes();
            let stretch = (2 << 20) / t.dtype.block_bytes() * t.dtype.block_bytes();
            let per = stretch / t.dtype.block_bytes() * t.dtype.block_len();
            bytes.chunks(stretch).enumerate().find_map(|(k, c)| {
                let bad = first_non_finite(t.dtype, c);
                t.data.release(k * stretch..k * stretch + c.len());
                bad.map(|i| (t, k * per + i))
            })
        });
        match bad {
            Some((t, i)) => Err(Error::tensor(
                &self.path,
                &t.name,
                format!(
                    "holds a non-finite value (NaN or Inf) at element {i}: the weights are corrupt"
                ),
            )),
            None => Ok(()),
        }
    }

    fn open_unchecked(path: Option<&Path>) -> Result<ModelFiles> {
        let Some(path) = path else {
            return Self::from_tinygpt_backing(
                Arc::new(Backing::Static(&BUNDLED.0)),
                Path::new(BUNDLED_NAME),
                Format::Bundled,
            );
        };
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Self::open_hf_dir(path);
        }
        // A FIFO would block in open(), a device has no size: only regular files hold models.
        regular_file(path)?;
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
            if n < 4 && meta.len() >= 4 {
                return Err(Error::format(path, "could not read the file header"));
            }
        }
        if &magic == b"GGUF" {
            return Self::open_gguf(path);
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext.eq_ignore_ascii_case("gguf") {
            return Err(Error::format(
                path,
                format!(
                    "not a GGUF file: it starts with {:02x?} instead of the magic \"GGUF\"",
                    &magic[..meta.len().min(4) as usize]
                ),
            ));
        }
        let backing = Arc::new(Backing::mmap(path)?);
        Self::from_tinygpt_backing(backing, path, Format::Tinygpt)
    }

    fn from_tinygpt_backing(
        backing: Arc<Backing>,
        path: &Path,
        format: Format,
    ) -> Result<ModelFiles> {
        let bytes = backing.bytes();
        check_safetensors_header(bytes, path)?;
        let (_, st_meta) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| Error::format(path, format!("not a .tinygpt/safetensors file: {e}")))?;
        let md = st_meta.metadata().clone().unwrap_or_default();
        let config_json = md.get(META_CONFIG).ok_or_else(|| {
            Error::format(
                path,
                format!("safetensors file has no '{META_CONFIG}' metadata: not a .tinygpt file (to load a Hugging Face model, pass its directory)"),
            )
        })?;
        let tok_json = md
            .get(META_TOKENIZER)
            .ok_or_else(|| Error::format(path, format!("missing '{META_TOKENIZER}' metadata")))?;
        let config = HfConfig::from_json(config_json, path)?.validate(path)?;
        let tensors = read_safetensors(&backing, path)?;
        let tokenizer = {
            let (json, config) = (tok_json.clone(), config.clone());
            PendingTokenizer::spawn(path, move |path| Tokenizer::from_json(&json, path, &config))
        };
        let file_bytes = bytes.len() as u64;
        Ok(ModelFiles {
            path: path.to_path_buf(),
            format,
            config,
            config_json: Some(config_json.clone()),
            tensors,
            tokenizer,
            tokenizer_json: Some(tok_json.clone()),
            chat_template: md.get(META_CHAT_TEMPLATE).cloned(),
            file_bytes,
        })
    }

    fn open_hf_dir(dir: &Path) -> Result<ModelFiles> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            return Err(Error::format(
                dir,
                "directory has no config.json (expected a Hugging Face model directory)",
            ));
        }
        let config_json = read_side_file(&config_path)?;
        let config = HfConfig::from_json(&config_json, &config_path)?.validate(&config_path)?;

        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = Vec::new();
        if single.exists() {
            files.push(single);
        } else if index.exists() {
            let text = read_side_file(&index)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::format(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::format(&index, "no 'weight_map' object"))?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(String::from))
                .collect();
            shards.sort();
            shards.dedup();
            for s in shards {
                if s.contains('/') || s.contains('\\') || s.contains("..") {
                    return Err(Error::format(
                        &index,
                        format!("shard name '{s}' is not a plain file name"),
                    ));
                }
                files.push(dir.join(s));
            }
        } else {
            return Err(Error::format(
                dir,
                "no model.safetensors or model.safetensors.index.json (only safetensors weights are supported)",
            ));
        }
        let mut tensors = BTreeMap::new();
        let mut file_bytes = 0u64;
        for f in &files {
            let backing = Arc::new(Backing::mmap(f)?);
            file_bytes += backing.bytes().len() as u64;
            for (name, t) in read_safetensors(&backing, f)? {
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::tensor(f, name, "appears in more than one shard"));
                }
            }
        }
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(Error::format(dir, "directory has no tokenizer.json"));
        }
        let tok_json = read_side_file(&tok_path)?;
        let tokenizer = {
            let (json, config) = (tok_json.clone(), config.clone());
            PendingTokenizer::spawn(&tok_path, move |path| {
                Tokenizer::from_json(&json, path, &config)
            })
        };
        let chat_template = read_chat_template(dir);
        Ok(ModelFiles {
            path: dir.to_path_buf(),
            format: Format::HfDir,
            config,
            config_json: Some(config_json),
            tensors,
            tokenizer,
            tokenizer_json: Some(tok_json),
            chat_template,
            file_bytes,
        })
    }

    fn open_gguf(path: &Path) -> Result<ModelFiles> {
        let gguf = Arc::new(crate::gguf::GgufFile::open(path)?);
        let config = gguf.config()?;
        let tokenizer = {
            let (gguf, config) = (gguf.clone(), config.clone());
            PendingTokenizer::spawn(path, move |path| {
                let built = Tokenizer::new(gguf.tokenizer()?, path, &config);
                // Building it leaves tens of MiB of small allocations (the parts read
                // from the metadata, a second vocabulary map), freed by now but kept by
                // the allocator: give them back while the weights are repacked.
                crate::memory::release_free_memory();
                built
            })
        };
        let tensors = Self::gguf_tensors(&gguf).map_err(|e| tokenizer.error_or(e))?;
        Ok(ModelFiles {
            path: path.to_path_buf(),
            format: Format::Gguf,
            config,
            config_json: None,
            tensors,
            tokenizer,
            tokenizer_json: None,
            chat_template: gguf.chat_template().map(String::from),
            file_bytes: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        })
    }

    /// The tensors of `gguf` under their Hugging Face names, borrowing its bytes where
    /// they are used as stored.
    fn gguf_tensors(gguf: &Arc<crate::gguf::GgufFile>) -> Result<BTreeMap<String, Tensor>> {
        let base = gguf.bytes().as_ptr() as usize;
        let file_len = gguf.bytes().len();
        let mut tensors = BTreeMap::new();
        let shared = Arc::new(Backing::Gguf(gguf.clone()));
        for t in gguf.hf_tensors()? {
            let data = match &t.data {
                std::borrow::Cow::Borrowed(b) => {
                    let start = b.as_ptr() as usize - base;
                    debug_assert!(start + b.len() <= file_len);
                    TensorBytes::new(shared.clone(), start, b.len())
                }
                std::borrow::Cow::Owned(v) => TensorBytes::owned(v),
            };
            tensors.insert(
                t.name.clone(),
                Tensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data,
                },
            );
        }
        Ok(tensors)
    }

    /// Total parameters (elements of every tensor).
    pub fn parameter_count(&self) -> usize {
        self.tensors.values().map(|t| t.numel()).sum()
    }

    /// Dtypes present in the file, with the number of tensors of each (every type is
    /// held as it is stored).
    pub fn dtype_summary(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for t in self.tensors.values() {
            *m.entry(t.dtype.name().to_string()).or_insert(0) += 1;
        }
        m
    }

    /// Looks up a tensor and checks its shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.path, name, "missing from the model file"))?;
        if t.shape != shape {
            return Err(Error::tensor(
                &self.path,
                name,
                format!(
                    "has shape {:?}, expected {:?} from the config",
                    t.shape, shape
                ),
            ));
        }
        Ok(t)
    }

    /// Same as [`get`](Self::get) for optional tensors (biases).
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<&Tensor>> {
        if self.tensors.contains_key(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Chat template from tokenizer_config.json (a string, or a list of named templates).
fn read_chat_template(dir: &Path) -> Option<String> {
    let text = read_side_file(&dir.join("tokenizer_config.json")).ok();
    let from_cfg = text.and_then(|t| {
        let v: serde_json::Value = serde_json::from_str(&t).ok()?;
        match v.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(a) => a.iter().find_map(|e| {
                (e.get("name")?.as_str()? == "default")
                    .then(|| e.get("template")?.as_str().map(String::from))
                    .flatten()
            }),
            _ => None,
        }
    });
    from_cfg.or_else(|| read_side_file(&dir.join("chat_template.jinja")).ok())
}

/// Largest JSON/text side file of a model directory read (tokenizer.json of a 256K
/// vocabulary is ~20 MiB).
pub const MAX_SIDE_FILE_BYTES: u64 = 256 << 20;

/// Metadata of `path`, refused unless it is a regular file (a FIFO would block in
/// `open`, `/dev/zero` never ends, a directory is not a file).
pub fn regular_file(path: &Path) -> Result<std::fs::Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, device or socket)"
        };
        return Err(Error::format(
            path,
            format!("is {kind}; expected a model file"),
        ));
    }
    Ok(meta)
}

/// Reads a side file (config.json, tokenizer.json, ...) as text: a regular file of at most
/// [`MAX_SIDE_FILE_BYTES`].
pub fn read_side_file(path: &Path) -> Result<String> {
    let meta = regular_file(path)?;
    if meta.len() > MAX_SIDE_FILE_BYTES {
        return Err(Error::format(
            path,
            format!(
                "is {} bytes; a model's JSON/text files are at most {} MiB",
                meta.len(),
                MAX_SIDE_FILE_BYTES >> 20
            ),
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| Error::format(path, format!("is not UTF-8 text ({e})")))
}

/// Checks a safetensors header the way the `safetensors` crate does, but naming the
/// tensor at fault: the header length, the JSON, and each tensor's shape, dtype and data
/// offsets against the data section.
pub fn check_safetensors_header(bytes: &[u8], path: &Path) -> Result<()> {
    if bytes.len() < 8 {
        return Err(Error::format(
            path,
            format!(
                "not a safetensors file: {} bytes, shorter than the 8-byte header length",
                bytes.len()
            ),
        ));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let rest = (bytes.len() - 8) as u64;
    if n > rest {
        return Err(Error::format(
            path,
            format!("not a safetensors file: the header length {n} runs past the end of the file ({} bytes)", bytes.len()),
        ));
    }
    let header = &bytes[8..8 + n as usize];
    let v: serde_json::Value = serde_json::from_slice(header).map_err(|e| {
        Error::format(
            path,
            format!("not a safetensors file: its header is not JSON ({e})"),
        )
    })?;
    let obj = v.as_object().ok_or_else(|| {
        Error::format(
            path,
            "not a safetensors file: its header is not a JSON object",
        )
    })?;
    let data_len = rest - n;
    for (name, info) in obj.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let bad = |m: String| Error::tensor(path, name, m);
        let dtype = info
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("has no 'dtype'".into()))?;
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .ok_or_else(|| bad("'shape' is not a list of non-negative integers".into()))?;
        let offsets: Vec<u64> = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| bad("'data_offsets' is not a pair of byte offsets".into()))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if begin > end || end > data_len {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] lie outside the data section ({data_len} bytes)"
            )));
        }
        let elem: Option<u64> = match dtype {
            "F64" | "I64" | "U64" => Some(8),
            "F32" | "I32" | "U32" => Some(4),
            "F16" | "BF16" | "I16" | "U16" => Some(2),
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
            _ => None,
        };
        let need = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|numel| elem.map(|e| numel.checked_mul(e)))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if let Some(need) = need {
            if need != end - begin {
                return Err(bad(format!(
                    "shape {shape:?} of {dtype} needs {need} bytes but data_offsets [{begin}, {end}] hold {}",
                    end - begin
                )));
            }
        }
    }
    Ok(())
}

/// Index of the first non-finite value of a tensor's bytes (for block types: the first
/// element of the first block whose f16 scale or minimum is NaN/Inf), or `None`.
///
/// A block type's values are its f16 scale fields times integer codes, levels and 6- or
/// 8-bit sub-scales, plus its minimums (ggml's formulas, [`crate::wkernels::dequant`]):
/// finite when every f16 field is (the largest, 65504 · 127 · 127 · 32, is far inside
/// f32), and when one is not, every value of its block is NaN or ±Inf (`Inf · 0` is NaN).
/// So the scan reads the f16 fields only; `tests/dequant.rs` checks it against the
/// dequantiser for every type.
pub fn first_non_finite(dtype: DType, bytes: &[u8]) -> Option<usize> {
    // An IEEE value is NaN/Inf when its exponent bits are all ones.
    fn scan16(bytes: &[u8], mask: u16) -> Option<usize> {
        bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes([c[0], c[1]]) & mask == mask)
    }
    let bad16 = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) & 0x7c00 == 0x7c00;
    match dtype {
        DType::F32 => {
            const MASK: u32 = 0x7f80_0000;
            // Word-wise OR-reduction first (vectorises), then locate.
            let bad_word = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & MASK == MASK;
            let mut base = 0;
            for chunk in bytes.chunks(4096) {
                if chunk
                    .chunks_exact(4)
                    .fold(false, |acc, c| acc | bad_word(c))
                {
                    return chunk.chunks_exact(4).position(bad_word).map(|i| base + i);
                }
                base += chunk.len() / 4;
            }
            None
        }
        DType::F16 => scan16(bytes, 0x7c00),
        DType::BF16 => scan16(bytes, 0x7f80),
        _ => {
            let fields = f16_fields(dtype);
            bytes
                .chunks_exact(dtype.block_bytes())
                .position(|b| fields.iter().any(|&at| bad16(b, at)))
                .map(|blk| blk * dtype.block_len())
        }
    }
}

/// Byte offsets of a block's f16 fields (its scale `d`, and its minimum `m` / `dmin` where
/// it has one), from ggml's block layouts (`tinygpt_types::ggml`).
pub fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        DType::F32 | DType::F16 | DType::BF16 => &[],
    }
}

/// Reads every tensor of a safetensors buffer, keeping views into `backing`.
fn read_safetensors(backing: &Arc<Backing>, path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = backing.bytes();
    check_safetensors_header(bytes, path)?;
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| Error::format(path, format!("invalid safetensors file: {e}")))?;
    let base = bytes.as_ptr() as usize;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("has dtype {other:?}; supported: F32, F16, BF16"),
                ))
            }
        };
        let data = view.data();
        let start = data.as_ptr() as usize - base;
        let elem = dtype.block_bytes();
        let tb = if start.is_multiple_of(elem) {
            TensorBytes::new(backing.clone(), start, data.len())
        } else {
            // Misaligned for its element type: copy once into an aligned buffer.
            TensorBytes::owned(data)
        };
        out.insert(
            name.clone(),
            Tensor {
                name,
                dtype,
                shape: view.shape().to_vec(),
                data: tb,
            },
        );
    }
    Ok(out)
}
