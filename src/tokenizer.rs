//! Text ↔ token ids, through the `tokenizers` crate, plus streaming detokenisation.
//!
//! [`Tokenizer::encode_bounded`] ([`bounded`]) tokenises a text that may be far longer
//! than a limit in tokens at a cost bounded by the limit, not by the text; a text within
//! the limit gets exactly the ids of encoding it whole.

mod bounded;
mod pending;

use crate::config::Config;
use crate::error::{Error, Result};
pub use bounded::Bounded;
use bounded::{Cuts, Segments, Spelled};
pub use pending::PendingTokenizer;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// A model's tokenizer with its special ids resolved.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Ids that end generation (config's `eos_token_id`, else the tokenizer's EOS-like token).
    pub eos_ids: Vec<u32>,
    pub bos_id: Option<u32>,
    /// Entries, added tokens included (`get_vocab_size(true)`, counted once).
    vocab_size: usize,
    /// Longest vocabulary entry, in bytes of its string form (an upper bound on the text
    /// one token stands for when no normalizer shortens the input).
    max_token_bytes: usize,
    /// Where a text may be cut for [`Self::encode_bounded`].
    cuts: Cuts,
    /// How its entries spell raw text, when known (for [`Self::encode_bounded`]).
    spelled: Option<Spelled>,
    /// Built the first time [`Self::encode_bounded`] meets a long run it cannot cut.
    segments: Arc<OnceLock<Option<Segments>>>,
}

impl Tokenizer {
    /// Parses a tokenizer.json text; `path` names it in errors.
    pub fn from_json(json: &str, path: &Path, cfg: &Config) -> Result<Self> {
        // Syntax first: tokenizers 0.22 panics ("Helper") on a syntax error inside the
        // "decoder" object instead of returning it (found by the safetensors_load fuzzer).
        serde_json::from_str::<serde::de::IgnoredAny>(json).map_err(|e| {
            Error::tokenizer(
                path,
                format!("cannot parse tokenizer.json: not valid JSON ({e})"),
            )
        })?;
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| Error::tokenizer(path, format!("cannot parse tokenizer.json: {e}")))?;
        Self::new(inner, path, cfg)
    }

    /// Wraps a built tokenizer and checks it fits the model's vocabulary.
    pub fn new(inner: tokenizers::Tokenizer, path: &Path, cfg: &Config) -> Result<Self> {
        // `get_vocab_size(true)` is this map's length, built again: a 150K vocabulary costs
        // a tenth of a second a map, so it is built once.
        let vocab = inner.get_vocab(true);
        let n = vocab.len();
        // The embedding may be padded past the tokenizer's vocabulary, never the reverse.
        let max_id = vocab.values().copied().max().unwrap_or(0) as usize;
        let max_token_bytes = vocab.keys().map(|k| k.len()).max().unwrap_or(1).max(1);
        if max_id >= cfg.vocab_size {
            return Err(Error::tokenizer(
                path,
                format!(
                    "vocabulary does not match the model: tokenizer has ids up to {max_id} ({n} tokens) but the model's vocab_size is {}",
                    cfg.vocab_size
                ),
            ));
        }
        let mut eos_ids = cfg.eos_token_ids.clone();
        if eos_ids.is_empty() {
            for t in ["</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>"] {
                if let Some(id) = inner.token_to_id(t) {
                    eos_ids.push(id);
                    break;
                }
            }
        }
        let cuts = Cuts::of(&inner, vocab.keys().map(String::as_str));
        // The model's own entries are the keys of `vocab` less the added tokens it lacks
        // (`get_vocab(true)` is the model's map with the added tokens inserted), so the
        // 150–260K-entry map is not built a second time.
        let added_only: std::collections::HashSet<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .map(|a| a.content)
            .filter(|c| tokenizers::Model::token_to_id(inner.get_model(), c).is_none())
            .collect();
        let model_entries = vocab
            .keys()
            .map(String::as_str)
            .filter(|k| !added_only.contains(*k));
        let spelled = cuts
            .spelling()
            .and_then(|s| Spelled::of(&inner, s, model_entries));
        Ok(Tokenizer {
            bos_id: cfg.bos_token_id,
            vocab_size: n,
            max_token_bytes,
            cuts,
            spelled,
            segments: Arc::new(OnceLock::new()),
            inner,
            path: path.to_path_buf(),
            eos_ids,
        })
    }

    /// The tokenizer's default encoding (special tokens added as the tokenizer adds them,
    /// e.g. a BOS for Llama-style post-processors), as transformers' `tokenizer(text)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::tokenizer(&self.path, format!("cannot encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::tokenizer(&self.path, format!("cannot decode: {e}")))
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
    pub fn token_to_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    /// Most bytes of text that can encode to `tokens` tokens or fewer: `tokens` times the
    /// longest vocabulary entry, times 4 when a normalizer may shorten the input first
    /// (NFKC maps a 3-byte full-width letter to 1 byte). Text longer than this is known to
    /// be over a `tokens` limit without tokenising it.
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        let shrink = if self.inner.get_normalizer().is_some() {
            4
        } else {
            1
        };
        tokens
            .saturating_mul(self.max_token_bytes)
            .saturating_mul(shrink)
    }

    /// Entries, added tokens included (the tokenizer's `get_vocab_size(true)`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns a growing id sequence into text deltas without re-decoding everything.
///
/// Keeps a two-point window `[prev, cur)` as candle's `TokenOutputStream` does: the new
/// text is `decode(ids[prev..]) − decode(ids[prev..cur])`, emitted only once it does not
/// end in an incomplete UTF-8 sequence. Decoding both sides from the same first token keeps
/// decoders that strip a leading space (SentencePiece) consistent.
pub struct StreamDecoder {
    ids: Vec<u32>,
    prev: usize,
    cur: usize,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> Self {
        StreamDecoder {
            ids: Vec::new(),
            prev: 0,
            cur: 0,
        }
    }

    /// Adds one id; returns the new text it completes (possibly empty).
    ///
    /// Ids before `prev` are dropped once emitted, so memory stays flat however long the
    /// stream runs; a tail that decodes to nothing for [`Self::MAX_PENDING`] ids (special
    /// tokens, which decoding skips) is flushed as it stands.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prev_text = if self.cur > self.prev {
            tok.decode(&self.ids[self.prev..self.cur])?
        } else {
            String::new()
        };
        let text = tok.decode(&self.ids[self.prev..])?;
        let mut delta = String::new();
        if text.len() > prev_text.len() && !text.ends_with('\u{FFFD}') {
            if let Some(d) = text.get(prev_text.len()..) {
                delta = d.to_string();
                self.prev = self.cur;
                self.cur = self.ids.len();
            }
        } else if self.ids.len() - self.cur > Self::MAX_PENDING {
            // Nothing printable for a long run of ids: restart the window after them.
            delta = text.get(prev_text.len()..).unwrap_or("").to_string();
            self.prev = self.ids.len();
            self.cur = self.ids.len();
        }
        if self.prev > 0 {
            self.ids.drain(..self.prev);
            self.cur -= self.prev;
            self.prev = 0;
        }
        Ok(delta)
    }

    /// Ids held beyond the last emitted text before they are flushed anyway.
    pub const MAX_PENDING: usize = 64;

    /// Ids held now (bounded: at most the last emitted run plus [`Self::MAX_PENDING`]).
    pub fn held(&self) -> usize {
        self.ids.len()
    }
}
