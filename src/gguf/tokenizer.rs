//! A `tokenizers::Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! A GGUF carries no `tokenizer.json`, only the pieces llama.cpp needs. This module puts them
//! back together the way transformers' GGUF conversion does
//! (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`: `byte_level_tokenizer`,
//! `add_gguf_special_tokens`, `set_split_regex`), so that both give the same ids:
//!
//! - `tokenizer.ggml.model = "gpt2"` → byte-level BPE: `tokens` become the vocabulary (a token
//!   written with characters outside GPT-2's byte alphabet is respelled byte by byte into it),
//!   `merges` ("a b" strings) the merge list, no `unk`, no dropout, ByteLevel decoder.
//! - Pre-tokenizer from `tokenizer.ggml.pre`: kinds with a known split regex
//!   ([`PRE_TOKENIZER_SPLITS`]: `llama-bpe`/`llama3`, `qwen2`, `tekken`, `gpt-4o`, ...) get
//!   `Sequence[Split(regex, isolated), ByteLevel(use_regex = false)]`; the kinds that split as
//!   GPT-2 does ([`GPT2_SPLIT_KINDS`], including SmolLM2's `smollm`) and a file without the
//!   key get plain `ByteLevel(add_prefix_space = false)`, whose built-in regex is GPT-2's.
//!   Any other kind is an error naming it (transformers would silently use GPT-2's regex). (llama.cpp's `smollm` also isolates every digit first, as the
//!   original SmolLM2 `tokenizer.json` does; transformers' conversion does not, and we follow
//!   transformers, which produced the golden ids. The SmolLM2 vocabulary has no merge that joins
//!   two digits, so the two differ rarely: on whitespace runs before a digit and around other
//!   numeric characters such as `½`; 40 of the 3001 parity cases in
//!   `fixtures/golden/smollm2_tokenizer_cases.json`.)
//! - Tokens of type 3 (CONTROL, e.g. `<|im_start|>`) become special added tokens (matched whole in
//!   the text, `normalized = false`); for byte-level vocabularies only when spelled in the byte
//!   alphabet, as transformers does. Type 4 (USER_DEFINED) become non-special added tokens. The
//!   bos/eos/unk/padding tokens are added as special tokens too.
//! - Post-processor: BOS is prepended when `tokenizer.ggml.add_bos_token` is true, EOS appended
//!   when `tokenizer.ggml.add_eos_token` is true (both default to false for gpt2 files; SmolLM2's
//!   file says false, so `encode(text, true)` adds nothing).
//!
//! - `tokenizer.ggml.model = "llama"` → SentencePiece, rebuilt as transformers does (a BPE
//!   with byte fallback; the `spm` module below says how).
//!
//! `t5` and other kinds are refused with an error naming the kind.

use super::reader::GgufValue;
use crate::error::{Error, Result};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::str::FromStr;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` kinds with their own split regex (transformers'
/// `GGUF_PRE_TOKENIZER_SPLITS`). Kinds not listed use GPT-2's regex inside `ByteLevel`.
pub const PRE_TOKENIZER_SPLITS: &[(&str, &str)] = &[
    ("llama3", LLAMA3_SPLIT),
    ("llama-v3", LLAMA3_SPLIT),
    ("llama-bpe", LLAMA3_SPLIT),
    ("falcon3", LLAMA3_SPLIT),
    ("falcon-h1", LLAMA3_SPLIT),
    ("pixtral", LLAMA3_SPLIT),
    ("midm-2.0", LLAMA3_SPLIT),
    ("lfm2", LLAMA3_SPLIT),
    ("jina-v5-nano", LLAMA3_SPLIT),
    ("dbrx", LLAMA3_SPLIT),
    ("smaug-bpe", LLAMA3_SPLIT),
    ("tekken", TEKKEN_SPLIT),
    ("qwen2", QWEN2_SPLIT),
    ("deepseek-r1-qwen", QWEN2_SPLIT),
    ("kormo", QWEN2_SPLIT),
    ("f2llmv2", QWEN2_SPLIT),
    ("megrez", QWEN2_SPLIT),
    ("qwen35", QWEN35_SPLIT),
    ("gpt-4o", GPT4O_SPLIT),
    ("llama4", GPT4O_SPLIT),
    ("kanana2", GPT4O_SPLIT),
    ("talkie", GPT4O_SPLIT),
    ("minimax-m2", GPT4O_SPLIT),
];

/// `tokenizer.ggml.pre` kinds that split with GPT-2's own regex (the built-in one of
/// `ByteLevel`), as transformers' conversion treats every kind it has no regex for. `smollm`
/// is here on purpose (see the module documentation); `default` is llama.cpp's name for
/// "no kind given". Any kind neither here nor in [`PRE_TOKENIZER_SPLITS`] is an error naming
/// it: guessing a split would give ids the model was not trained on.
pub const GPT2_SPLIT_KINDS: &[&str] = &[
    "default",
    "gpt2",
    "gpt-2",
    "smollm",
    "phi-2",
    "jina-es",
    "jina-de",
    "jina-v1-es",
    "jina-v2-es",
    "jina-v2-de",
];

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// GPT-2's byte → printable character table (`bytes_to_unicode`): printable Latin-1 bytes map
/// to themselves, the other 68 bytes to U+0100.. in byte order.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    table
}

fn strings<'m>(
    meta: &'m BTreeMap<String, GgufValue>,
    key: &str,
    path: &Path,
) -> Result<Option<&'m [String]>> {
    match meta.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(a)) => a.as_strings().map(Some).ok_or_else(|| {
            Error::tokenizer(
                path,
                format!(
                    "'{key}' must be an array of strings, got an array of {}",
                    a.elem_type_name()
                ),
            )
        }),
        Some(v) => Err(Error::tokenizer(
            path,
            format!("'{key}' must be an array, got a {}", v.type_name()),
        )),
    }
}

fn opt_id(
    meta: &BTreeMap<String, GgufValue>,
    key: &str,
    n: usize,
    path: &Path,
) -> Result<Option<usize>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
            Some(id) if id < n => Ok(Some(id)),
            _ => Err(Error::tokenizer(
                path,
                format!("'{key}' = {v:?} is not a token id (vocabulary has {n} tokens)"),
            )),
        },
    }
}

fn opt_bool(meta: &BTreeMap<String, GgufValue>, key: &str, path: &Path) -> Result<Option<bool>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| Error::tokenizer(path, format!("'{key}' must be a bool, got {v:?}"))),
    }
}

/// Builds the tokenizer; `path` names the file in errors.
///
/// The tokenizer is built from its parts: the JSON document of [`tokenizer_json`] without
/// its vocabulary, merges and added tokens (a few hundred bytes to parse), then the BPE
/// model built from the vocabulary and merges directly and the added tokens added, as the
/// JSON loader does (both kinds: gpt2's byte-level BPE and SentencePiece's). The same tokenizer as loading the whole
/// document (tests compare the two serialised), without turning a 150K-entry vocabulary
/// into JSON and back: that took a second of a 0.5B model's load.
pub fn build(meta: &BTreeMap<String, GgufValue>, path: &Path) -> Result<tokenizers::Tokenizer> {
    if meta.get("tokenizer.ggml.model").and_then(GgufValue::as_str) == Some("llama") {
        let mut parts = spm::Parts::read(meta, path)?;
        let bpe = parts.bpe();
        let added = parts.added.iter().map(|&(_, t, special)| (t, special));
        return assemble(parts.skeleton(), bpe, added, path);
    }
    let mut parts = Gpt2Parts::read(meta, path)?;
    let skeleton = parts.json(Map::new(), Vec::new(), json!([]));
    // The builder takes the vocabulary and merges owned: the parts' own are moved into it
    // or freed first, not held beside its copies (the build's memory peak, which lands on
    // the weights being repacked meanwhile, `ModelFiles::open`).
    let vocab: tokenizers::models::bpe::Vocab =
        std::mem::take(&mut parts.vocab).into_iter().collect();
    let merges = std::mem::take(&mut parts.merges)
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .fuse_unk(false)
        .byte_fallback(false)
        .ignore_merges(false)
        .build();
    let added = parts
        .added
        .iter()
        .map(|(_, t, special)| (t.as_str(), *special));
    assemble(&skeleton, bpe, added, path)
}

/// The tokenizer of `skeleton` (a document without vocabulary, merges and added tokens)
/// with `bpe` as its model and the `added` tokens `(content, special)` added, as the JSON
/// loader adds a document's (`tokenizers`' `TokenizerVisitor`: `add_tokens`, in order).
fn assemble<'a>(
    skeleton: &Value,
    bpe: tokenizers::Result<tokenizers::models::bpe::BPE>,
    added: impl Iterator<Item = (&'a str, bool)>,
    path: &Path,
) -> Result<tokenizers::Tokenizer> {
    let mut tok = from_json(&skeleton.to_string(), path)?;
    let bpe = bpe.map_err(|e| {
        Error::tokenizer(
            path,
            format!("the tokenizer.ggml.* metadata does not make a valid tokenizer: {e}"),
        )
    })?;
    tok.with_model(bpe);
    let added: Vec<_> = added
        .map(|(content, special)| {
            tokenizers::AddedToken::from(content.to_string(), special)
                .single_word(false)
                .lstrip(false)
                .rstrip(false)
                .normalized(false)
        })
        .collect();
    tok.add_tokens(&added);
    Ok(tok)
}

/// The `added_tokens` of a document: `(id, content, special)` each, in order.
fn added_json<'a>(added: impl Iterator<Item = (u32, &'a str, bool)>) -> Value {
    added
        .map(|(id, content, special)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            })
        })
        .collect()
}

/// Parses a `tokenizer.json` document generated here.
fn from_json(json: &str, path: &Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_str(json).map_err(|e| {
        // The position is in JSON generated here, not in the file: drop it.
        let msg = e.to_string();
        let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
        Error::tokenizer(
            path,
            format!("the tokenizer.ggml.* metadata does not make a valid tokenizer: {msg}"),
        )
    })
}

/// The `tokenizer.json` text equivalent to the file's tokenizer metadata (what [`build`]
/// builds; also what a `.tinygpt` conversion stores).
pub fn tokenizer_json(meta: &BTreeMap<String, GgufValue>, path: &Path) -> Result<String> {
    if meta.get("tokenizer.ggml.model").and_then(GgufValue::as_str) == Some("llama") {
        return spm::tokenizer_json(meta, path);
    }
    let parts = Gpt2Parts::read(meta, path)?;
    let mut vocab_json = Map::new();
    let mut by_id: Vec<(&String, u32)> = parts.vocab.iter().map(|(k, &v)| (k, v)).collect();
    by_id.sort_by_key(|&(_, id)| id);
    for (k, id) in by_id {
        vocab_json.insert(k.clone(), json!(id));
    }
    let merges_json = parts.merges.iter().map(|(a, b)| json!([a, b])).collect();
    let added = added_json(parts.added.iter().map(|(i, t, sp)| (*i, t.as_str(), *sp)));
    Ok(parts.json(vocab_json, merges_json, added).to_string())
}

/// A gpt2 tokenizer's parts, checked: the vocabulary respelled into the byte alphabet, the
/// merges, the added tokens `(id, content, special)`, pre-tokenizer and post-processor.
struct Gpt2Parts<'m> {
    vocab: HashMap<String, u32>,
    merges: Vec<(&'m str, &'m str)>,
    added: Vec<(u32, String, bool)>,
    pre_tokenizer: Value,
    post_processor: Value,
}

impl<'m> Gpt2Parts<'m> {
    fn read(meta: &'m BTreeMap<String, GgufValue>, path: &Path) -> Result<Gpt2Parts<'m>> {
        let m = Gpt2Meta::read(meta, path)?;
        let alphabet = ByteAlphabet::new();
        let vocab = vocabulary(m.tokens, &alphabet);
        let merges = merges(m.merges, &vocab, m.tokens.len(), path)?;
        let added = added_tokens(meta, &m, &vocab, &alphabet, path)?;
        Ok(Gpt2Parts {
            vocab,
            merges,
            added,
            pre_tokenizer: pre_tokenizer(m.pre, path)?,
            post_processor: post_processor(meta, m.tokens, path)?,
        })
    }

    /// The document with the given vocabulary, merges and added tokens.
    fn json(&self, vocab: Map<String, Value>, merges: Vec<Value>, added: Value) -> Value {
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": self.pre_tokenizer,
            "post_processor": self.post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": "",
                "end_of_word_suffix": "",
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": merges,
            },
        })
    }
}

/// The `tokenizer.ggml.*` arrays of a gpt2 (byte-level BPE) tokenizer, type-checked.
struct Gpt2Meta<'m> {
    tokens: &'m [String],
    merges: &'m [String],
    /// Empty when the file has no `token_type`; else one per token.
    token_types: Vec<i64>,
    pre: Option<&'m str>,
}

impl<'m> Gpt2Meta<'m> {
    fn read(meta: &'m BTreeMap<String, GgufValue>, path: &Path) -> Result<Gpt2Meta<'m>> {
        let err = |msg: String| Error::tokenizer(path, msg);
        let model = match meta.get("tokenizer.ggml.model") {
            None => return Err(err("missing metadata 'tokenizer.ggml.model'".into())),
            Some(v) => v.as_str().ok_or_else(|| {
                err(format!(
                    "'tokenizer.ggml.model' must be a string, got {v:?}"
                ))
            })?,
        };
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model '{model}' is not supported (supported: gpt2, i.e. byte-level BPE; llama, i.e. SentencePiece)"
            )));
        }
        let tokens = strings(meta, "tokenizer.ggml.tokens", path)?
            .ok_or_else(|| err("missing metadata 'tokenizer.ggml.tokens'".into()))?;
        let merges = strings(meta, "tokenizer.ggml.merges", path)?.ok_or_else(|| {
            err("missing metadata 'tokenizer.ggml.merges' (a gpt2 tokenizer needs them)".into())
        })?;
        let token_types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(GgufValue::Array(a)) => {
                let v = a.to_i64s().ok_or_else(|| {
                    err(format!(
                        "'tokenizer.ggml.token_type' must be integers, got {}",
                        a.elem_type_name()
                    ))
                })?;
                if v.len() != tokens.len() {
                    return Err(err(format!(
                        "'tokenizer.ggml.token_type' has {} entries for {} tokens",
                        v.len(),
                        tokens.len()
                    )));
                }
                v
            }
            Some(v) => {
                return Err(err(format!(
                    "'tokenizer.ggml.token_type' must be an array, got {v:?}"
                )))
            }
        };
        let pre =
            match meta.get("tokenizer.ggml.pre") {
                None => None,
                Some(v) => Some(v.as_str().ok_or_else(|| {
                    err(format!("'tokenizer.ggml.pre' must be a string, got {v:?}"))
                })?),
            };
        Ok(Gpt2Meta {
            tokens,
            merges,
            token_types,
            pre,
        })
    }
}

/// GPT-2's byte alphabet: which characters it has, and how to respell raw bytes into it.
struct ByteAlphabet {
    table: [char; 256],
    has: [bool; 0x180],
}

impl ByteAlphabet {
    fn new() -> ByteAlphabet {
        let table = bytes_to_unicode();
        let mut has = [false; 0x180];
        for &c in &table {
            has[c as usize] = true;
        }
        ByteAlphabet { table, has }
    }

    /// Whether every character of `t` is in the alphabet.
    fn spells(&self, t: &str) -> bool {
        t.chars()
            .all(|c| (c as usize) < self.has.len() && self.has[c as usize])
    }

    /// `t` as is if it is spelled in the alphabet, else its UTF-8 bytes respelled.
    fn respell(&self, t: &str) -> String {
        if self.spells(t) {
            t.to_string()
        } else {
            t.bytes().map(|b| self.table[b as usize]).collect()
        }
    }
}

/// The vocabulary, respelled into the byte alphabet where needed. A later duplicate
/// spelling wins, as in transformers' dict comprehension.
fn vocabulary(tokens: &[String], alphabet: &ByteAlphabet) -> HashMap<String, u32> {
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(alphabet.respell(t), id as u32);
    }
    vocab
}

/// The merges as `[a, b]` pairs; each must be two tokens whose concatenation is a token too.
fn merges<'m>(
    merges: &'m [String],
    vocab: &HashMap<String, u32>,
    n_tokens: usize,
    path: &Path,
) -> Result<Vec<(&'m str, &'m str)>> {
    let err = |msg: String| Error::tokenizer(path, msg);
    let mut merges_json = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                // The BPE model refuses a merge whose parts or result are not tokens; say
                // which metadata entry, not where in the generated JSON.
                for part in [a, b, &format!("{a}{b}")] {
                    if !vocab.contains_key(part) {
                        return Err(err(format!(
                            "tokenizer.ggml.merges #{i} {m:?} uses {part:?}, which is not among the {n_tokens} entries of tokenizer.ggml.tokens"
                        )));
                    }
                }
                merges_json.push((a, b));
            }
            _ => {
                return Err(err(format!(
                    "merge #{i} {m:?} is not two tokens separated by one space"
                )))
            }
        }
    }
    Ok(merges_json)
}

/// Added tokens, by id: control tokens spelled in the byte alphabet and user-defined tokens
/// present in the vocabulary, then the bos/eos/unk/pad tokens.
fn added_tokens(
    meta: &BTreeMap<String, GgufValue>,
    m: &Gpt2Meta<'_>,
    vocab: &HashMap<String, u32>,
    alphabet: &ByteAlphabet,
    path: &Path,
) -> Result<Vec<(u32, String, bool)>> {
    let n = m.tokens.len();
    // id -> (content, special)
    let mut added: BTreeMap<u32, (String, bool)> = BTreeMap::new();
    for (t, &ty) in m.tokens.iter().zip(&m.token_types) {
        if t.is_empty() {
            continue; // an empty added token would match everywhere
        }
        let special = match ty {
            TOKEN_TYPE_CONTROL if alphabet.spells(t) => true,
            TOKEN_TYPE_USER_DEFINED if vocab.contains_key(t.as_str()) => false,
            _ => continue,
        };
        if let Some(&id) = vocab.get(t.as_str()) {
            added.entry(id).or_insert_with(|| (t.clone(), special));
        }
    }
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        if let Some(id) = opt_id(meta, key, n, path)? {
            let t = &m.tokens[id];
            if t.is_empty() {
                continue;
            }
            if let Some(&vid) = vocab.get(t.as_str()) {
                added.entry(vid).or_insert_with(|| (t.clone(), true));
            }
        }
    }
    Ok(added
        .into_iter()
        .map(|(id, (content, special))| (id, content, special))
        .collect())
}

/// Byte-level pre-tokenizer, preceded by the split regex of `tokenizer.ggml.pre` when it
/// has its own ([`PRE_TOKENIZER_SPLITS`]); GPT-2's built-in regex for the kinds in
/// [`GPT2_SPLIT_KINDS`] and for a file without the key; an error for any other kind.
fn pre_tokenizer(pre: Option<&str>, path: &Path) -> Result<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let Some(pre) = pre else {
        return Ok(byte_level(true));
    };
    if let Some((_, regex)) = PRE_TOKENIZER_SPLITS.iter().find(|(k, _)| *k == pre) {
        return Ok(json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ],
        }));
    }
    if GPT2_SPLIT_KINDS.contains(&pre) {
        return Ok(byte_level(true));
    }
    let known: Vec<&str> = PRE_TOKENIZER_SPLITS
        .iter()
        .map(|(k, _)| *k)
        .chain(GPT2_SPLIT_KINDS.iter().copied())
        .collect();
    Err(Error::tokenizer(
        path,
        format!(
            "tokenizer.ggml.pre '{pre}' is not a pre-tokenizer this engine knows (known: {})",
            known.join(", ")
        ),
    ))
}

/// Template post-processor: BOS before / EOS after each sequence, as `add_bos_token` /
/// `add_eos_token` ask.
fn post_processor(
    meta: &BTreeMap<String, GgufValue>,
    tokens: &[String],
    path: &Path,
) -> Result<Value> {
    let n = tokens.len();
    let bos = opt_id(meta, "tokenizer.ggml.bos_token_id", n, path)?;
    let eos = opt_id(meta, "tokenizer.ggml.eos_token_id", n, path)?;
    let add_bos = opt_bool(meta, "tokenizer.ggml.add_bos_token", path)?.unwrap_or(false);
    let add_eos = opt_bool(meta, "tokenizer.ggml.add_eos_token", path)?.unwrap_or(false);
    let special_of = |add: bool, id: Option<usize>, what: &str| -> Result<Option<(String, u32)>> {
        if !add {
            return Ok(None);
        }
        let id = id.ok_or_else(|| {
            Error::tokenizer(
                path,
                format!("tokenizer.ggml.add_{what}_token is true but there is no {what} token id"),
            )
        })?;
        Ok(Some((tokens[id].clone(), id as u32)))
    };
    let bos_t = special_of(add_bos, bos, "bos")?;
    let eos_t = special_of(add_eos, eos, "eos")?;
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (seq, type_id, out) in [("A", 0, &mut single), ("B", 1, &mut pair)] {
        if let Some((t, _)) = &bos_t {
            out.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
        out.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
        if let Some((t, _)) = &eos_t {
            out.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
    }
    let pair: Vec<Value> = single.iter().cloned().chain(pair).collect();
    let mut specials = Map::new();
    for (t, id) in bos_t.iter().chain(eos_t.iter()) {
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    Ok(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": specials,
    }))
}

/// SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma),
/// rebuilt as transformers' GGUF conversion does (`GGUFTokenizerSkeleton`,
/// `GGUFLlamaConverter` / `GGUFGemmaConverter`): a BPE model over the `tokens` with byte
/// fallback (`<0xNN>` tokens, type 6) and `fuse_unk`, whose merges — the file has none — are
/// every split of a token into two tokens, ordered by the merged token's score (highest
/// first; within one token by the parts' scores), which is SentencePiece's own merge order.
/// Spaces become `▁` (normaliser), with a `▁` prepended when `add_space_prefix` is true
/// (the default, as in llama.cpp). Control tokens (type 3) are special added tokens,
/// user-defined ones (type 4, e.g. Gemma's newline runs) plain added tokens, both matched
/// whole. BOS is prepended when `add_bos_token` is true (the default for this model kind).
mod spm {
    use super::{opt_bool, opt_id, strings, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};
    use crate::error::{Error, Result};
    use crate::gguf::reader::GgufValue;
    use serde_json::{json, Map, Value};
    use std::collections::{BTreeMap, HashMap};
    use std::path::Path;

    /// A SentencePiece tokenizer's parts, checked (as [`super::Gpt2Parts`]): the vocabulary,
    /// merges, added tokens `(id, content, special)`, unknown token, and the document
    /// without those.
    pub(super) struct Parts<'m> {
        pub vocab: Vec<(&'m str, u32)>,
        pub merges: Vec<(&'m str, &'m str)>,
        pub added: Vec<(u32, &'m str, bool)>,
        pub unk: Option<&'m str>,
        skeleton: Value,
    }

    impl<'m> Parts<'m> {
        pub fn read(meta: &'m BTreeMap<String, GgufValue>, path: &Path) -> Result<Parts<'m>> {
            let err = |msg: String| Error::tokenizer(path, msg);
            let tokens = strings(meta, "tokenizer.ggml.tokens", path)?
                .ok_or_else(|| err("missing metadata 'tokenizer.ggml.tokens'".into()))?;
            let n = tokens.len();
            let (scores, types) = scores_and_types(meta, n, path)?;
            let unk = opt_id(meta, "tokenizer.ggml.unknown_token_id", n, path)?;
            let bos = opt_id(meta, "tokenizer.ggml.bos_token_id", n, path)?;
            let eos = opt_id(meta, "tokenizer.ggml.eos_token_id", n, path)?;
            let add_bos = opt_bool(meta, "tokenizer.ggml.add_bos_token", path)?.unwrap_or(true);
            let add_eos = opt_bool(meta, "tokenizer.ggml.add_eos_token", path)?.unwrap_or(false);
            let add_prefix =
                opt_bool(meta, "tokenizer.ggml.add_space_prefix", path)?.unwrap_or(true);

            let (vocab, merges) = vocab_and_merges(tokens, &scores);
            let added = added_tokens(tokens, &types);
            let normalizer = match add_prefix {
                true => json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ]}),
                false => json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}),
            };
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if add_prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let (single, specials) = template(tokens, (add_bos, bos), (add_eos, eos), path)?;
            let skeleton = json!({
                "version": "1.0",
                "truncation": null,
                "padding": null,
                "added_tokens": [],
                "normalizer": normalizer,
                "pre_tokenizer": null,
                "post_processor": {
                    "type": "TemplateProcessing",
                    "single": single,
                    "pair": single,
                    "special_tokens": specials,
                },
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {
                    "type": "BPE",
                    "dropout": null,
                    "unk_token": null,
                    "continuing_subword_prefix": null,
                    "end_of_word_suffix": null,
                    "fuse_unk": true,
                    "byte_fallback": true,
                    "ignore_merges": false,
                    "vocab": {},
                    "merges": [],
                },
            });
            Ok(Parts {
                vocab,
                merges,
                added,
                unk: unk.map(|u| tokens[u].as_str()),
                skeleton,
            })
        }

        /// The document without vocabulary, merges, added tokens and unknown token.
        pub fn skeleton(&self) -> &Value {
            &self.skeleton
        }

        /// The BPE model of the vocabulary and merges, with the document's options. Takes
        /// them from `self` (their owned copies are the builder's; these are freed before
        /// it builds, not held beside its maps at the build's memory peak).
        pub fn bpe(&mut self) -> tokenizers::Result<tokenizers::models::bpe::BPE> {
            let vocab: tokenizers::models::bpe::Vocab = std::mem::take(&mut self.vocab)
                .into_iter()
                .map(|(t, i)| (t.to_string(), i))
                .collect();
            let merges = std::mem::take(&mut self.merges)
                .into_iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let mut b = tokenizers::models::bpe::BPE::builder()
                .vocab_and_merges(vocab, merges)
                .fuse_unk(true)
                .byte_fallback(true)
                .ignore_merges(false);
            if let Some(u) = self.unk {
                b = b.unk_token(u.to_string());
            }
            b.build()
        }
    }

    pub fn tokenizer_json(meta: &BTreeMap<String, GgufValue>, path: &Path) -> Result<String> {
        let parts = Parts::read(meta, path)?;
        let mut doc = parts.skeleton.clone();
        let mut vocab = Map::new();
        for &(t, i) in &parts.vocab {
            vocab.insert(t.to_string(), json!(i));
        }
        doc["model"]["vocab"] = Value::Object(vocab);
        doc["model"]["merges"] = parts.merges.iter().map(|(l, r)| json!([l, r])).collect();
        doc["model"]["unk_token"] = json!(parts.unk);
        doc["added_tokens"] = super::added_json(parts.added.iter().copied());
        Ok(doc.to_string())
    }

    /// `tokenizer.ggml.scores` (required) and `tokenizer.ggml.token_type` (all 1, normal,
    /// when absent), one per token.
    fn scores_and_types(
        meta: &BTreeMap<String, GgufValue>,
        n: usize,
        path: &Path,
    ) -> Result<(Vec<f32>, Vec<i64>)> {
        let err = |msg: String| Error::tokenizer(path, msg);
        let scores = match meta.get("tokenizer.ggml.scores") {
            Some(GgufValue::Array(a)) => a.to_f32s().ok_or_else(|| {
                err(format!(
                    "'tokenizer.ggml.scores' must be numbers, got {}",
                    a.elem_type_name()
                ))
            })?,
            Some(v) => {
                return Err(err(format!(
                    "'tokenizer.ggml.scores' must be an array, got a {}",
                    v.type_name()
                )))
            }
            None => return Err(err(
                "missing metadata 'tokenizer.ggml.scores' (a SentencePiece tokenizer needs them)"
                    .into(),
            )),
        };
        let types = match meta.get("tokenizer.ggml.token_type") {
            Some(GgufValue::Array(a)) => a
                .to_i64s()
                .ok_or_else(|| err("'tokenizer.ggml.token_type' must be integers".into()))?,
            _ => vec![1; n],
        };
        if scores.len() != n || types.len() != n {
            return Err(err(format!(
                "tokenizer.ggml.scores has {} and tokenizer.ggml.token_type {} entries for {n} tokens",
                scores.len(),
                types.len()
            )));
        }
        Ok((scores, types))
    }

    /// The vocabulary (token → id) and the merges: every split of a token into two tokens,
    /// ordered by the merged token's score, highest first (within one token by the parts'
    /// scores).
    #[allow(clippy::type_complexity)]
    fn vocab_and_merges<'m>(
        tokens: &'m [String],
        scores: &[f32],
    ) -> (Vec<(&'m str, u32)>, Vec<(&'m str, &'m str)>) {
        let n = tokens.len();
        // id of each token (a later duplicate wins, as in a dict comprehension)
        let mut ids: HashMap<&str, u32> = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            ids.insert(t.as_str(), i as u32);
        }
        let score = |t: &str| {
            ids.get(t)
                .map_or(f32::NEG_INFINITY, |&i| scores[i as usize])
        };
        // Every split of every token into two tokens: (left, right, merged score).
        let mut merges: Vec<(&str, &str, f32)> = Vec::new();
        for t in tokens {
            let start = merges.len();
            for (cut, _) in t.char_indices().skip(1) {
                let (l, r) = t.split_at(cut);
                if ids.contains_key(l) && ids.contains_key(r) {
                    merges.push((l, r, score(t)));
                }
            }
            // within a token: by the parts' scores, highest first (a stable sort)
            merges[start..].sort_by(|a, b| {
                (score(b.0), score(b.1))
                    .partial_cmp(&(score(a.0), score(a.1)))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        }
        merges.sort_by(|a, b| b.2.total_cmp(&a.2));
        let mut vocab: Vec<(&str, u32)> = ids.into_iter().collect();
        vocab.sort_by_key(|&(_, i)| i);
        (vocab, merges.into_iter().map(|(l, r, _)| (l, r)).collect())
    }

    /// Control tokens as special added tokens, user-defined ones as plain added tokens.
    fn added_tokens<'m>(tokens: &'m [String], types: &[i64]) -> Vec<(u32, &'m str, bool)> {
        let mut added = Vec::new();
        for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            let special = match ty {
                TOKEN_TYPE_CONTROL => true,
                TOKEN_TYPE_USER_DEFINED => false,
                _ => continue,
            };
            if t.is_empty() {
                continue;
            }
            added.push((i as u32, t.as_str(), special));
        }
        added
    }

    /// The post-processor's `single` template (BOS, the sequence, EOS, each special token
    /// only when its `add_*_token` is on) and its `special_tokens`; an `add_*_token` without
    /// the token's id is an error.
    fn template(
        tokens: &[String],
        (add_bos, bos): (bool, Option<usize>),
        (add_eos, eos): (bool, Option<usize>),
        path: &Path,
    ) -> Result<(Vec<Value>, Map<String, Value>)> {
        let err = |msg: String| Error::tokenizer(path, msg);
        let mut single = Vec::new();
        let mut specials = Map::new();
        for (on, id, what) in [
            (add_bos, bos, "bos"),
            (false, None, ""),
            (add_eos, eos, "eos"),
        ] {
            if what.is_empty() {
                single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
                continue;
            }
            if !on {
                continue;
            }
            let id = id.ok_or_else(|| {
                err(format!(
                    "tokenizer.ggml.add_{what}_token is true but there is no {what} token id"
                ))
            })?;
            let t = &tokens[id];
            single.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
            specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
        }
        Ok((single, specials))
    }
}
