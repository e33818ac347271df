//! The server's prompt cache (`--prompt-cache-bytes`, docs/design.md §4): finished
//! sequences' caches, kept so that a later request whose prompt starts with what one of
//! them computed resumes from it and prefills only the rest (a chat client re-sends the
//! whole conversation every turn).
//!
//! * **What is kept**: when a sequence ends (EOS, a stop string, `max_tokens`, the request
//!   timeout, or its client went away; not after an error), its cache with the ids whose
//!   rows it holds, `prompt + generated[..fed]` (the last sampled token is never fed), and
//!   its cache configuration. Requests with another [`KvConfig`] never match it.
//! * **Where it resumes**: the scheduler starts a hold ([`KvCache::hold`], design.md §3.2)
//!   when a sequence's prompt is all prefilled, so an entry holds its generated rows and
//!   can be resumed from any point `r` from its prompt's end (`from`) to its end:
//!   [`KvCache::released_copy`]`(r - from)` is bit for bit the cache of only those `r`
//!   rows. A request resumes from the entry and point with the longest match `r` of its
//!   prompt's ids with the entry's ids; at least one prompt token must run (its logits
//!   start the sampling), so `r` is at most the prompt's length − 1, and a match below the
//!   entry's `from` is no match. The resumed request then prefills its prompt from `r` on
//!   the same path as any prompt, so it computes exactly what recomputing would.
//! * **Bounded**: an entry costs the worst-case bytes admission counts for a cache of its
//!   ids ([`super::worst_case_kv_bytes`]) or, if more, what its buffers take
//!   ([`KvCache::buffer_bytes`]), plus everything else it puts on the heap as the
//!   allocator lays it out: the hold's journal, the bookkeeping (per-head lists, the
//!   stores, ~1,400 blocks for a 30-layer model) with each block's header and rounding
//!   ([`KvCache::copy_blocks`], [`memory::heap_block_bytes`]), its ids (`entry_cost`).
//!   The entries' costs sum to at most `--prompt-cache-bytes`, the least recently used
//!   leaving first. An entry is a copy of the finished cache (the running one's buffers
//!   grew by doubling; the copy's hold what they count), so what it counts is what it
//!   holds.
//!   An entry that does not fit with its hold is kept without it (resumable at its end
//!   only), or not at all. A running sequence's hold is bounded too ([`bound_hold`]): at
//!   most [`HOLD_ROWS`] rows and the limit in bytes; past them it commits what it held
//!   and holds afresh, so the entry resumes within its last generated rows.
//! * Entries are copied, never handed out: a hit copies the entry's cache released to
//!   `r` (the entry stays for other requests, e.g. a regenerated reply); an entry whose
//!   every resume point a newer one offers is dropped when the newer one is kept.

use crate::kv_cache::{KvCache, KvConfig};
use crate::memory;

/// Most rows a running sequence holds at once (see [`bound_hold`]): a chat reply is
/// usually shorter, so its kept entry can resume anywhere inside it.
pub const HOLD_ROWS: usize = 512;

/// The LRU of kept caches (see the module docs).
#[derive(Debug)]
pub struct PromptCache {
    limit: usize,
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    kv: KvConfig,
    /// The ids whose rows the cache holds, in order.
    ids: Vec<u32>,
    /// The earliest point it resumes from: `ids.len()` minus the rows its hold holds.
    from: usize,
    cache: KvCache,
    /// What it counts against the limit.
    cost: usize,
    /// When it was last kept or used (for the LRU order).
    used: u64,
    /// The id of the completion that left it.
    completion: String,
}

/// A finished sequence offered to the cache.
pub struct Finished {
    pub kv: KvConfig,
    /// The ids whose rows `cache` holds ([`fed_ids`]).
    pub ids: Vec<u32>,
    pub cache: KvCache,
    /// [`super::worst_case_kv_bytes`] of a cache of `ids.len()` tokens with `kv`.
    pub worst_case: usize,
    /// The id of the completion (`chatcmpl-N`, `cmpl-N`).
    pub completion: String,
}

/// What [`PromptCache::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inserted {
    /// The ids can be resumed from the cache now (this entry, or one kept before that
    /// offers every point this one would).
    pub kept: bool,
    /// Cache bytes freed (the entries dropped, and the offered cache's own buffers), for
    /// the caller's decision to give memory back.
    pub freed: usize,
}

/// A hit: the cache released to the resume point, and how many prompt ids it covers.
pub struct Resume {
    pub cache: KvCache,
    pub reused: usize,
}

impl PromptCache {
    /// An empty cache whose entries' costs stay within `limit` bytes (0: keeps nothing).
    pub fn new(limit: usize) -> PromptCache {
        PromptCache {
            limit,
            entries: Vec::new(),
            bytes: 0,
            clock: 0,
        }
    }

    /// `--prompt-cache-bytes`.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// What the entries count against the limit.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The entry and point a request with cache settings `kv` and prompt `prompt` resumes
    /// from: the longest match (the most recently used entry among equals), or `None`.
    pub fn lookup(&mut self, kv: &KvConfig, prompt: &[u32]) -> Option<Resume> {
        let last = prompt.len().checked_sub(1)?;
        let (i, r) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.kv == *kv)
            .filter_map(|(i, e)| {
                let r = common_prefix(&e.ids, prompt).min(last);
                (r >= e.from && r > 0).then_some((i, r, e.used))
            })
            .max_by_key(|&(_, r, used)| (r, used))
            .map(|(i, r, _)| (i, r))?;
        let now = self.tick();
        let e = &mut self.entries[i];
        e.used = now;
        Some(Resume {
            cache: e.cache.released_copy(r - e.from),
            reused: r,
        })
    }

    /// Keeps a finished sequence's cache if it fits (dropping the least recently used
    /// entries to make room, and the entries it makes useless), as a copy the size of what
    /// it holds.
    pub fn insert(&mut self, f: Finished) -> Inserted {
        let Finished {
            kv,
            mut ids,
            mut cache,
            worst_case,
            mut completion,
        } = f;
        let appended = cache.layer(0).appended();
        let mut dropped = 0;
        let refused = |cache: &KvCache, kept| Inserted {
            kept,
            freed: cache.buffer_bytes() + cache.hold_bytes(),
        };
        if self.limit == 0 || ids.is_empty() || ids.len() != appended {
            return refused(&cache, false);
        }
        // Kept as they are counted.
        ids.shrink_to_fit();
        completion.shrink_to_fit();
        let mut cost = entry_cost(&cache, worst_case, &ids, &completion);
        if cost > self.limit {
            // Without its hold it resumes at its end only, but may fit.
            cache.release(usize::MAX);
            cost = entry_cost(&cache, worst_case, &ids, &completion);
        }
        if cost > self.limit {
            return refused(&cache, false);
        }
        let from = ids.len() - cache.held().unwrap_or(0);
        // An entry that offers every resume point of this one already: keep that one.
        let now = self.tick();
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.kv == kv && e.from <= from && e.ids.starts_with(&ids))
        {
            e.used = now;
            return refused(&cache, true);
        }
        // Entries whose every resume point this one offers too.
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            if e.kv == kv && from <= e.from && ids.starts_with(&e.ids) {
                dropped += self.remove(i);
            } else {
                i += 1;
            }
        }
        while self.bytes + cost > self.limit {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            dropped += self.remove(oldest);
        }
        // Kept compacted: a running cache's buffers grew by doubling, a copy's are the
        // size of what they hold, so the entry holds what it counts (the running one's
        // memory is freed here, layer by layer as each is copied).
        dropped += cache.buffer_bytes() + cache.hold_bytes();
        let kept = cache.into_compact();
        let used = self.tick();
        self.bytes += cost;
        self.entries.push(Entry {
            kv,
            ids,
            from,
            cache: kept,
            cost,
            used,
            completion,
        });
        Inserted {
            kept: true,
            freed: dropped,
        }
    }

    /// Drops entry `i`; returns the bytes its cache held.
    fn remove(&mut self, i: usize) -> usize {
        let e = self.entries.swap_remove(i);
        self.bytes -= e.cost;
        e.cache.buffer_bytes() + e.cache.hold_bytes()
    }

    /// The state the completion `completion` left, released to its end (no hold): its
    /// cache settings, ids and cache, for saving.
    pub fn state_of(&mut self, completion: &str) -> Option<(KvConfig, Vec<u32>, KvCache)> {
        if completion.is_empty() {
            // Restored entries have no completion id.
            return None;
        }
        let e = self
            .entries
            .iter_mut()
            .find(|e| e.completion == completion)?;
        let cache = e.cache.released_copy(usize::MAX);
        Some((e.kv.clone(), e.ids.clone(), cache))
    }
}

/// What an entry keeping a copy of `cache` with `ids` and `completion` counts against
/// the limit: the worst case admission counts for its ids or, if more, what the copy's
/// buffers take ([`KvCache::buffer_bytes`]: ring slots and KIVI group parameters that
/// hold no stored row, row positions), plus everything else the copy and the entry put
/// on the heap as the allocator lays it out ([`memory::heap_block_bytes`] of each block
/// [`KvCache::copy_blocks`] names: the hold's journal, per-head lists, the stores
/// themselves, each block's header and rounding), the ids and the completion's id.
pub fn entry_cost(cache: &KvCache, worst_case: usize, ids: &[u32], completion: &str) -> usize {
    let mut heap = 0;
    cache.copy_blocks(&mut |n| heap += memory::heap_block_bytes(n));
    let buffers = cache.buffer_bytes();
    let beside = heap.saturating_sub(buffers)
        + memory::heap_block_bytes(std::mem::size_of_val(ids))
        + memory::heap_block_bytes(completion.len())
        + std::mem::size_of::<Entry>();
    worst_case.max(buffers) + beside
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The ids whose rows a finished sequence's `cache` holds: `prompt` and the generated
/// tokens that were fed (all but the last sampled one, normally), as many as the cache
/// appended; `None` when that is not a prompt-and-generated prefix (a sequence that
/// ended inside its prompt).
pub fn fed_ids(prompt: &[u32], generated: &[u32], cache: &KvCache) -> Option<Vec<u32>> {
    let rows = (cache.n_layers() > 0).then(|| cache.layer(0).appended())?;
    let fed = rows.checked_sub(prompt.len())?;
    if fed > generated.len() {
        return None;
    }
    let mut ids = Vec::with_capacity(rows);
    ids.extend_from_slice(prompt);
    ids.extend_from_slice(&generated[..fed]);
    Some(ids)
}

/// Keeps a running sequence's hold within [`HOLD_ROWS`] rows and `limit` bytes (its cache
/// and hold together, as an entry would count them): past either, it commits what it
/// holds and holds afresh from here; if even a fresh hold does not fit, it stops holding
/// (the entry it leaves then resumes at its end only, if it fits at all). Without a hold,
/// does nothing.
pub fn bound_hold(cache: &mut KvCache, limit: usize) {
    let Some(held) = cache.held() else {
        return;
    };
    if held < HOLD_ROWS && cache.buffer_bytes() + cache.hold_bytes() <= limit {
        return;
    }
    cache.hold();
    if cache.buffer_bytes() + cache.hold_bytes() > limit {
        cache.release(usize::MAX);
    }
}
