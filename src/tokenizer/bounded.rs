//! Tokenising a text that may be far longer than a limit in tokens, at a cost bounded by
//! the limit ([`Tokenizer::encode_bounded`]).
//!
//! Two facts make it possible without a second tokenizer:
//!
//! * where a text can be cut ([`Cuts`]), its ids are those of the two sides, concatenated:
//!   the text is encoded chunk by chunk and counted;
//! * every token stands for a vocabulary entry (or an added token), so a text needs at
//!   least as many tokens as the fewest entries it can be spelled with ([`Segments`], a
//!   trie of the entries as raw bytes): a bound on a long run that cannot be cut (a
//!   megabyte of `a`), computed left to right in time linear in the run.
//!
//! Together with "the rest of the text needs at least one token per longest entry", the
//! count of the text is bounded from below at every step, and the encoding stops as soon as
//! that bound passes the limit.

use super::Tokenizer;
use crate::error::{Error, Result};
use serde_json::Value;
use std::collections::VecDeque;

/// What [`Tokenizer::encode_bounded`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    /// The text's ids, at most the limit.
    Ids(Vec<u32>),
    /// The text encodes to more tokens than the limit: `at_least` of them, the exact
    /// count when `exact`.
    Over { at_least: usize, exact: bool },
}

impl Tokenizer {
    /// Tokenises `text` as [`encode_with`](Self::encode_with) does, unless it is longer
    /// than `limit` tokens: then it stops as soon as that is certain and says how many
    /// tokens it is known to have at least. The work done is bounded by the limit, not
    /// by the text, where the text can be cut ([`Cuts`]): chunks of about
    /// [`Self::CHUNK_BYTES`] bytes are encoded one after the other and counted, a chunk
    /// much longer than that (a run with no place to cut) is first bounded by
    /// [`Segments`], and the rest of the text cannot encode to fewer than one token per
    /// [`max_text_bytes(1)`](Self::max_text_bytes) bytes. Within the limit, the ids are
    /// exactly those of encoding the whole text (the chunks' ids, concatenated, with the
    /// special tokens the post-processor adds).
    pub fn encode_bounded(
        &self,
        text: &str,
        add_special_tokens: bool,
        limit: usize,
    ) -> Result<Bounded> {
        self.encode_bounded_in(text, add_special_tokens, limit, Self::CHUNK_BYTES)
    }

    /// Bytes of text [`encode_bounded`](Self::encode_bounded) encodes at a time.
    pub const CHUNK_BYTES: usize = 16 << 10;

    /// A chunk at least this long is bounded by [`Segments`] before it is encoded.
    const SEGMENT_BOUND_BYTES: usize = 64 << 10;

    /// [`encode_bounded`](Self::encode_bounded) with chunks of `chunk` bytes (tests use
    /// small ones, to cut a text at every place it can be cut).
    pub fn encode_bounded_in(
        &self,
        text: &str,
        add_special_tokens: bool,
        limit: usize,
        chunk: usize,
    ) -> Result<Bounded> {
        let per_token = match &self.spelled {
            Some(sp) => sp.max_bytes,
            None => self.max_text_bytes(1),
        }
        .max(1);
        let covered = |bytes: &[u8]| {
            self.spelled
                .as_ref()
                .map_or(bytes.len(), |sp| sp.covered(bytes))
        };
        // The special tokens the post-processor adds around the text.
        let specials = match self.inner.get_post_processor() {
            Some(p) if add_special_tokens => tokenizers::PostProcessor::added_tokens(p, false),
            _ => 0,
        };
        // The least count of the whole text, `counted` tokens of it known, `rest` bytes
        // that tokens must cover not.
        let least = |counted: usize, rest: usize| {
            counted
                .saturating_add(specials)
                .saturating_add(rest.div_ceil(per_token))
        };
        let over = |at_least, exact| Ok(Bounded::Over { at_least, exact });
        let mut rest = covered(text.as_bytes());
        if least(0, rest) > limit {
            return over(least(0, rest), false);
        }
        let err = |e| Error::tokenizer(&self.path, format!("cannot encode: {e}"));
        let mut parts = Vec::new();
        let mut counted = 0usize;
        let mut start = 0;
        while start < text.len() {
            // Without a place to cut, the rest is encoded whole.
            let end = self
                .cuts
                .next(text, start.saturating_add(chunk.max(1)))
                .unwrap_or(text.len());
            let run = &text.as_bytes()[start..end];
            rest -= covered(run);
            if run.len() >= Self::SEGMENT_BOUND_BYTES {
                if let Some(seg) = self.segments() {
                    let passes = |lb: usize| least(counted + lb, rest) > limit;
                    match seg.least_tokens(run, passes) {
                        Least::Stopped(lb) => return over(least(counted + lb, rest), false),
                        Least::Total(lb) if passes(lb) => {
                            return over(least(counted + lb, rest), false)
                        }
                        _ => {}
                    }
                }
            }
            let enc = self
                .inner
                .encode_fast(&text[start..end], false)
                .map_err(err)?;
            counted += enc.len();
            let at_least = least(counted, rest);
            if at_least > limit {
                return over(at_least, end == text.len());
            }
            parts.push(enc);
            start = end;
        }
        let merged = tokenizers::Encoding::merge(parts, false);
        let ids = self
            .inner
            .post_process(merged, None, add_special_tokens)
            .map_err(err)?
            .get_ids()
            .to_vec();
        if ids.len() > limit {
            return over(ids.len(), true);
        }
        Ok(Bounded::Ids(ids))
    }

    /// Whether [`encode_bounded`](Self::encode_bounded) can cut texts for this tokenizer
    /// (else it encodes them whole, after the byte-length check).
    pub fn cuts_texts(&self) -> bool {
        !matches!(self.cuts, Cuts::Never)
    }

    /// Builds what [`encode_bounded`](Self::encode_bounded) needs for long runs it cannot
    /// cut (a trie of the vocabulary: a few MiB, up to ~2 s for a 262k-entry vocabulary on
    /// a busy machine), so that the first such prompt does not wait for it. A server calls
    /// it on a thread of its own at start; clones of this tokenizer share the result.
    pub fn prepare_bounds(&self) {
        let _ = self.segments();
    }

    /// The trie of [`Segments`], built the first time a long run needs it; `None` when
    /// this tokenizer's entries cannot be spelled as raw bytes ([`Spelling::Unknown`]).
    fn segments(&self) -> Option<&Segments> {
        let sp = self.spelled.as_ref()?;
        self.segments
            .get_or_init(|| Segments::of(&self.inner, sp))
            .as_ref()
    }
}

/// What a tokenizer's vocabulary says about the raw text one token stands for, when its
/// entries spell raw bytes in a known way ([`Spelling`]).
#[derive(Debug, Clone)]
pub(crate) struct Spelled {
    spelling: Spelling,
    /// Bytes no token need cover: a character the vocabulary cannot spell is dropped (no
    /// `unk`) or becomes `unk`, perhaps one for a run of them.
    droppable: [bool; 256],
    any_droppable: bool,
    /// Most raw bytes one token stands for (entries and added tokens).
    max_bytes: usize,
}

impl Spelled {
    /// `None` when `spelling` is unknown. `model_entries`: the model's vocabulary entries
    /// (the keys of `t.get_vocab(false)`, without added tokens the model lacks).
    pub(crate) fn of<'a>(
        t: &tokenizers::Tokenizer,
        spelling: Spelling,
        model_entries: impl Iterator<Item = &'a str>,
    ) -> Option<Spelled> {
        let mut present = [false; 256];
        let mut max_bytes = 1;
        for entry in model_entries {
            match spelling.raw(entry) {
                Raw::Byte(b) => present[b as usize] = true,
                Raw::Text(raw) => {
                    if let [b] = raw[..] {
                        present[b as usize] |= spelling == Spelling::ByteLevel;
                    }
                    max_bytes = max_bytes.max(raw.len());
                }
                Raw::None => {}
                Raw::Unknown => return None,
            }
        }
        for a in t.get_added_tokens_decoder().into_values() {
            max_bytes = max_bytes.max(a.content.len());
        }
        let droppable = present.map(|p| !p);
        Some(Spelled {
            spelling,
            any_droppable: droppable.contains(&true),
            droppable,
            max_bytes,
        })
    }

    /// Bytes of `bytes` some token must cover.
    fn covered(&self, bytes: &[u8]) -> usize {
        if !self.any_droppable {
            return bytes.len();
        }
        bytes
            .iter()
            .filter(|&&b| !self.droppable[b as usize])
            .count()
    }
}

/// A vocabulary entry as raw text ([`Spelling::raw`]).
enum Raw {
    /// A byte-fallback entry: this one byte.
    Byte(u8),
    Text(Vec<u8>),
    /// Not text the model can produce from raw text (outside the byte alphabet).
    None,
    Unknown,
}

/// How a tokenizer's vocabulary entries spell raw text, for [`Spelled`] and [`Segments`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spelling {
    /// GPT-2's byte alphabet, one character per byte, no normalizer.
    ByteLevel,
    /// `▁` for a space (the normalizer's only change), `<0xNN>` entries for single bytes
    /// (byte fallback).
    SentencePiece,
    /// Otherwise: no bound from the entries.
    Unknown,
}

impl Spelling {
    /// The raw text vocabulary entry `entry` stands for.
    fn raw(self, entry: &str) -> Raw {
        match self {
            Spelling::ByteLevel => {
                let byte_of = byte_alphabet();
                entry
                    .chars()
                    .map(byte_of)
                    .collect::<Option<Vec<u8>>>()
                    .map_or(Raw::None, Raw::Text)
            }
            Spelling::SentencePiece => {
                let hex = entry.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
                match hex
                    .filter(|h| h.len() == 2)
                    .map(|h| u8::from_str_radix(h, 16))
                {
                    Some(Ok(b)) => Raw::Byte(b),
                    _ => Raw::Text(entry.replace('\u{2581}', " ").into_bytes()),
                }
            }
            Spelling::Unknown => Raw::Unknown,
        }
    }
}

/// GPT-2's byte alphabet, character → byte.
fn byte_alphabet() -> impl Fn(char) -> Option<u8> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<char, u8>> =
        std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        crate::gguf::tokenizer::bytes_to_unicode()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    });
    move |c| table.get(&c).copied()
}

/// Where a text may be cut so that its ids are the ids of the part before the cut followed
/// by those of the part after it (the post-processor's special tokens aside).
///
/// The cut is before an ASCII space whose previous character is ASCII punctuation, an
/// ASCII letter or digit, or (without a compatibility normalizer, which may turn a letter
/// into text ending in a space) any other letter or digit. It is exact for the pipelines
/// [`Cuts::of`] recognises, because each splits there before its model runs:
///
/// * a byte-level BPE whose pre-tokenizer is `ByteLevel` with its regex (GPT-2's), or a
///   `Split` by one of the regexes of [`crate::gguf::tokenizer::PRE_TOKENIZER_SPLITS`]
///   (Llama 3, Qwen 2, ...) followed by `ByteLevel` without one: no alternative of these
///   regexes matches a non-space character followed by a space (a space is only ever the
///   first character of a match), none looks behind, and their one look-ahead (`\s+(?!\S)`)
///   reads one character past a whitespace match, so the matches before the cut are the
///   same with or without the text after it, and matching starts afresh at the cut. The
///   model then encodes each match on its own. Normalizers that work character by
///   character and never join a character to a following space (NFC, NFKC, lower-casing)
///   keep this.
/// * a SentencePiece-style BPE without pre-tokenizer whose normalizer only replaces spaces
///   by `▁` (the GGUF `llama` vocabularies, e.g. Gemma 3): merges only join symbols into
///   vocabulary entries, so no merge can cross the cut when no entry holds the character
///   before it followed by `▁` (`not_after` lists the characters that some entry does hold
///   so: for Gemma 3, `>` of `>▁</`), and merges on either side then happen in the same
///   order as without the other side.
///
/// Either way the added tokens must not straddle a cut or eat the space after them: none
/// may hold a space after a non-space character, strip the whitespace to its right, or be
/// single-word. Any other pipeline (`Prepend` normalizers, which would add a `▁` at every
/// chunk; unknown regexes; WordPiece, Unigram; truncation or padding, which the
/// post-processor would apply to each chunk) is never cut.
#[derive(Debug, Clone)]
pub(crate) enum Cuts {
    Never,
    BeforeSpace {
        /// Characters before a space where the text must not be cut anyway.
        not_after: Vec<char>,
        /// Non-ASCII letters and digits may precede a cut.
        unicode: bool,
        /// How the entries spell raw text.
        spelling: Spelling,
    },
}

impl Cuts {
    /// The cut rule of `t`, whose vocabulary entries (added tokens included) are `vocab`.
    pub(crate) fn of<'a>(t: &tokenizers::Tokenizer, vocab: impl Iterator<Item = &'a str>) -> Cuts {
        let json = |v: Option<Value>| v.unwrap_or(Value::Null);
        let normalizer = json(
            t.get_normalizer()
                .and_then(|n| serde_json::to_value(n).ok()),
        );
        let pre = json(
            t.get_pre_tokenizer()
                .and_then(|p| serde_json::to_value(p).ok()),
        );
        let tokenizers::models::ModelWrapper::BPE(bpe) = t.get_model() else {
            return Cuts::Never;
        };
        let none = |s: &Option<String>| s.as_deref().is_none_or(str::is_empty);
        let plain_bpe = bpe.dropout.is_none_or(|d| d == 0.0)
            && none(&bpe.continuing_subword_prefix)
            && none(&bpe.end_of_word_suffix);
        let added_ok = t
            .get_added_tokens_decoder()
            .values()
            .all(|a| !a.rstrip && !a.single_word && !has_space_after_non_space(&a.content));
        if !plain_bpe || !added_ok || t.get_truncation().is_some() || t.get_padding().is_some() {
            return Cuts::Never;
        }
        let Some(unicode) = normalizer_keeps_cuts(&normalizer) else {
            return Cuts::Never;
        };
        if byte_level_regex(&pre) {
            let spelling = if normalizer.is_null() {
                Spelling::ByteLevel
            } else {
                Spelling::Unknown
            };
            return Cuts::BeforeSpace {
                not_after: Vec::new(),
                unicode,
                spelling,
            };
        }
        let replaces_spaces = normalizer["type"] == "Replace"
            && normalizer["pattern"]["String"] == " "
            && normalizer["content"] == "\u{2581}";
        if pre.is_null() && replaces_spaces && !bpe.ignore_merges {
            let mut not_after: Vec<char> = Vec::new();
            for token in vocab {
                for (p, c) in token.chars().zip(token.chars().skip(1)) {
                    if c == '\u{2581}' && p != '\u{2581}' && !not_after.contains(&p) {
                        not_after.push(p);
                    }
                }
            }
            let spelling = if bpe.byte_fallback {
                Spelling::SentencePiece
            } else {
                Spelling::Unknown
            };
            return Cuts::BeforeSpace {
                not_after,
                unicode,
                spelling,
            };
        }
        Cuts::Never
    }

    /// How the entries spell raw text (`None` when texts are never cut).
    pub(crate) fn spelling(&self) -> Option<Spelling> {
        match self {
            Cuts::BeforeSpace { spelling, .. } => Some(*spelling),
            Cuts::Never => None,
        }
    }

    /// The first cut at or after byte `from` of `text`, if any.
    fn next(&self, text: &str, from: usize) -> Option<usize> {
        let Cuts::BeforeSpace {
            not_after, unicode, ..
        } = self
        else {
            return None;
        };
        let bytes = text.as_bytes();
        let mut i = from.max(1);
        while i < bytes.len() {
            let at = i + bytes[i..].iter().position(|&b| b == b' ')?;
            let prev = text[..at].chars().next_back()?;
            let kind = if prev.is_ascii() {
                prev.is_ascii_graphic()
            } else {
                *unicode && prev.is_alphanumeric()
            };
            if kind && !not_after.contains(&prev) {
                return Some(at);
            }
            i = at + 1;
        }
        None
    }
}

/// Whether `s` holds a space (or `▁`) after a character that is not whitespace.
fn has_space_after_non_space(s: &str) -> bool {
    let space = |c: char| c.is_whitespace() || c == '\u{2581}';
    s.chars()
        .zip(s.chars().skip(1))
        .any(|(p, c)| (c == ' ' || c == '\u{2581}') && !space(p))
}

/// `Some(unicode)` when normalizer `n` (as its JSON) keeps the cuts exact, `unicode` being
/// whether non-ASCII letters and digits may still precede a cut (not after a compatibility
/// normalization, which maps some of them to text with spaces).
fn normalizer_keeps_cuts(n: &Value) -> Option<bool> {
    match n["type"].as_str() {
        None if n.is_null() => Some(true),
        Some("NFC" | "NFD" | "Lowercase") => Some(true),
        Some("NFKC" | "NFKD") => Some(false),
        Some("Replace") if n["pattern"]["String"] == " " => Some(true),
        Some("Sequence") => n["normalizers"]
            .as_array()?
            .iter()
            .try_fold(true, |u, m| Some(u && normalizer_keeps_cuts(m)?)),
        _ => None,
    }
}

/// Whether pre-tokenizer `p` (as its JSON) is `ByteLevel` with GPT-2's regex, or a `Split`
/// by a known regex followed by `ByteLevel` without one.
fn byte_level_regex(p: &Value) -> bool {
    let byte_level = |v: &Value, regex: bool| v["type"] == "ByteLevel" && v["use_regex"] == regex;
    if byte_level(p, true) {
        return true;
    }
    let Some([split, bl]) = p["pretokenizers"].as_array().map(Vec::as_slice) else {
        return false;
    };
    let known = split["pattern"]["Regex"].as_str().is_some_and(|r| {
        crate::gguf::tokenizer::PRE_TOKENIZER_SPLITS
            .iter()
            .any(|(_, k)| *k == r)
    });
    p["type"] == "Sequence"
        && split["type"] == "Split"
        && known
        && split["behavior"] == "Isolated"
        && split["invert"] == false
        && byte_level(bl, false)
}

/// The strings a text's tokens can stand for, as raw bytes: every vocabulary entry (as its
/// [`Spelling`] spells it) and every added token, in a trie whose node `n` has the children
/// `edge_node[child_start[n]..child_start[n + 1]]`, sorted by `edge_byte`.
///
/// Any encoding of a text is a way to spell it with these strings, one per token, so the
/// fewest strings that spell it (a shortest path over its byte positions) is a lower bound
/// on its token count. Entries that cannot be spelled (outside the byte alphabet) are left
/// out: the model never produces them from text; strings that might be spelled two ways
/// (`<0x41>` as a byte and as text) are in both ways. More strings only lower the bound.
pub(crate) struct Segments {
    child_start: Vec<u32>,
    edge_byte: Vec<u8>,
    edge_node: Vec<u32>,
    terminal: Vec<bool>,
    /// Longest string, in bytes.
    longest: usize,
    /// Bytes that cost nothing ([`Spelled::droppable`]).
    droppable: [bool; 256],
}

/// What [`Segments::least_tokens`] found.
enum Least {
    /// Its `stop` ended the walk on seeing this bound.
    Stopped(usize),
    /// The fewest strings that spell the whole text.
    Total(usize),
    /// The text cannot be spelled (not valid for the tokenizer).
    Unspellable,
}

impl Segments {
    /// The trie of `t`'s strings spelled as `sp` says; `None` when an added token stands
    /// for more than its text (it strips whitespace next to it).
    fn of(t: &tokenizers::Tokenizer, sp: &Spelled) -> Option<Segments> {
        let mut strings: Vec<Vec<u8>> = Vec::new();
        for entry in t.get_vocab(false).into_keys() {
            if let Raw::Byte(b) = sp.spelling.raw(&entry) {
                strings.push(vec![b]);
            }
            if let Raw::Text(raw) = sp.spelling.raw(&entry) {
                strings.push(raw);
            }
            // A byte-fallback entry may be spelled as its own text too.
            if sp.spelling == Spelling::SentencePiece {
                strings.push(entry.replace('\u{2581}', " ").into_bytes());
            }
        }
        for a in t.get_added_tokens_decoder().into_values() {
            if a.lstrip || a.rstrip {
                return None;
            }
            strings.push(a.content.replace('\u{2581}', " ").into_bytes());
            strings.push(a.content.into_bytes());
        }
        strings.retain(|s| !s.is_empty());
        strings.sort_unstable();
        strings.dedup();
        let mut seg = Segments::build(&strings);
        seg.droppable = sp.droppable;
        Some(seg)
    }

    /// The trie of `strings` (sorted, distinct, non-empty), breadth first.
    fn build(strings: &[Vec<u8>]) -> Segments {
        let mut seg = Segments {
            child_start: Vec::new(),
            edge_byte: Vec::new(),
            edge_node: Vec::new(),
            terminal: vec![false],
            longest: strings.iter().map(Vec::len).max().unwrap_or(1),
            droppable: [false; 256],
        };
        // (the strings under the node, its depth), in node order.
        let mut queue: VecDeque<(usize, usize, usize)> = VecDeque::from([(0, strings.len(), 0)]);
        while let Some((mut lo, hi, depth)) = queue.pop_front() {
            seg.child_start.push(seg.edge_byte.len() as u32);
            if lo < hi && strings[lo].len() == depth {
                lo += 1; // this node's own string (sorted first), marked by its parent
            }
            while lo < hi {
                let b = strings[lo][depth];
                let end = lo + strings[lo..hi].partition_point(|s| s[depth] == b);
                let child = seg.terminal.len() as u32;
                seg.terminal.push(strings[lo].len() == depth + 1);
                seg.edge_byte.push(b);
                seg.edge_node.push(child);
                queue.push_back((lo, end, depth + 1));
                lo = end;
            }
        }
        seg.child_start.push(seg.edge_byte.len() as u32);
        seg
    }

    fn child(&self, node: u32, b: u8) -> Option<u32> {
        let (s, e) = (
            self.child_start[node as usize] as usize,
            self.child_start[node as usize + 1] as usize,
        );
        let i = self.edge_byte[s..e].binary_search(&b).ok()?;
        Some(self.edge_node[s + i])
    }

    /// The fewest strings that spell `text`, computed left to right; `stop` is asked at
    /// every byte with a lower bound on that number, and ends the walk when it says so.
    ///
    /// The bound at byte `i`: the best spelling of the whole text has a boundary `j` in
    /// `(i − longest, i]`, reached by its first `k ≥ fewest(j)` strings, and the
    /// bytes after it that a string must cover (not [`Spelled::droppable`]: those cost
    /// nothing) need at least one more string per `longest` of them; the least of the two
    /// summed over that window (a monotonic queue) is the bound.
    fn least_tokens(&self, text: &[u8], mut stop: impl FnMut(usize) -> bool) -> Least {
        let (n, l) = (text.len(), self.longest);
        let size = l + 1;
        // fewest[j % size] for the positions j in [i, i + l] not yet passed.
        let mut fewest = vec![u32::MAX; size];
        fewest[0] = 0;
        let mut window: VecDeque<(usize, usize)> = VecDeque::new();
        // Bytes after i that some string must cover.
        let mut covered_after = text
            .iter()
            .filter(|&&b| !self.droppable[b as usize])
            .count();
        for i in 0..n {
            let d = std::mem::replace(&mut fewest[i % size], u32::MAX);
            if d != u32::MAX {
                let key = d as usize + covered_after.div_ceil(l);
                while window.back().is_some_and(|&(_, k)| k >= key) {
                    window.pop_back();
                }
                window.push_back((i, key));
            }
            while window.front().is_some_and(|&(p, _)| p + l <= i) {
                window.pop_front();
            }
            let bound = window.front().map_or(0, |&(_, k)| k);
            if stop(bound) {
                return Least::Stopped(bound);
            }
            let droppable = self.droppable[text[i] as usize];
            covered_after -= usize::from(!droppable);
            if d == u32::MAX {
                continue;
            }
            if droppable {
                let slot = &mut fewest[(i + 1) % size];
                *slot = (*slot).min(d);
            }
            let mut node = 0u32;
            for (k, &b) in text[i..n.min(i + l)].iter().enumerate() {
                let Some(c) = self.child(node, b) else { break };
                node = c;
                if self.terminal[c as usize] {
                    let slot = &mut fewest[(i + k + 1) % size];
                    *slot = (*slot).min(d + 1);
                }
            }
        }
        match fewest[n % size] {
            u32::MAX => Least::Unspellable,
            last => Least::Total(last as usize),
        }
    }
}
