//! Hold bookkeeping of one store: an undo journal of what each append overwrote while a
//! hold runs (docs/design.md §3.2, `kv_cache/hold.rs`).
//!
//! A store writes its buffers through [`Journal::write`], which, while the journal holds,
//! first saves the elements the write will overwrite (those that existed before it) and
//! the buffer's length. [`Journal::mark`] opens each append's share of the journal;
//! [`Journal::rewind`]`(keep)` hands the writes of the appends after the first `keep`
//! back, newest first, to the store, which puts the old bytes back and truncates the
//! buffer to its old length ([`restore`]), and holds on, recording the first `keep`
//! appends only; [`Journal::stop`] ends the hold (a release is a rewind, then a stop).
//! Undoing every write of an append, newest append first, leaves each buffer exactly (length and every element) as it was before
//! that append: the first write of a slot saved the bytes from before the hold, a later
//! write saved the bytes the earlier one left, and the undo runs in reverse.
//!
//! Not holding, a write costs one branch beyond the store's own work; holding, it also
//! copies the overwritten elements once (nothing when the write only grows the buffer).
//! The journal is empty when not holding and is never part of a saved state.

use bytemuck::Pod;
use std::ops::Range;

/// One recorded write: buffer `head` of the store's field `field` held `old_len`
/// elements, and the elements from `at` on that the write overwrote are in `saved[saved..]`
/// (up to the next entry's `saved`).
#[derive(Debug, Clone, Copy)]
struct Entry {
    field: u8,
    head: u32,
    at: usize,
    old_len: usize,
    saved: usize,
}

/// Hold bookkeeping, empty when not holding (see the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct Journal {
    holding: bool,
    /// `entries.len()` when each append since the hold began started.
    marks: Vec<usize>,
    entries: Vec<Entry>,
    /// The overwritten elements, as bytes.
    saved: Vec<u8>,
}

impl Journal {
    /// Starts recording (a journal already holding is emptied first: its appends kept).
    pub(crate) fn hold(&mut self) {
        *self = Journal {
            holding: true,
            ..Journal::default()
        };
    }

    /// Opens the share of the journal of one append (call it once at the start of each
    /// append of the store); nothing when not holding.
    #[inline]
    pub(crate) fn mark(&mut self) {
        if self.holding {
            self.marks.push(self.entries.len());
        }
    }

    /// Makes `buf` (buffer `head` of field `field`) hold at least `range.end` elements
    /// (growing with `Default` values) and returns `buf[range]` for the caller to overwrite; while
    /// holding, first saves what is there.
    #[inline]
    pub(crate) fn write<'a, T: Pod + Default>(
        &mut self,
        field: u8,
        head: usize,
        buf: &'a mut Vec<T>,
        range: Range<usize>,
    ) -> &'a mut [T] {
        let old_len = buf.len();
        if self.holding {
            let old = range.start.min(old_len)..range.end.min(old_len);
            self.entries.push(Entry {
                field,
                head: head as u32,
                at: old.start,
                old_len,
                saved: self.saved.len(),
            });
            self.saved
                .extend_from_slice(bytemuck::cast_slice(&buf[old]));
        }
        super::ensure(buf, range.end);
        &mut buf[range]
    }

    /// Undoes the appends after the first `keep` while holding on: calls
    /// `restore(field, head, at, old bytes, old_len)` for every write of those appends,
    /// newest first (see [`restore`]), and forgets them; the journal then records the
    /// first `keep` appends only, as if the later ones had never happened. Nothing when
    /// `keep` ≥ the appends recorded, or when not holding.
    pub(crate) fn rewind(
        &mut self,
        keep: usize,
        mut restore: impl FnMut(u8, usize, usize, &[u8], usize),
    ) {
        let Some(&from) = self.marks.get(keep) else {
            return;
        };
        let mut end = self.saved.len();
        for e in self.entries[from..].iter().rev() {
            restore(
                e.field,
                e.head as usize,
                e.at,
                &self.saved[e.saved..end],
                e.old_len,
            );
            end = e.saved;
        }
        self.saved.truncate(end);
        self.entries.truncate(from);
        self.marks.truncate(keep);
    }

    /// Ends the hold keeping every append: empties the journal.
    pub(crate) fn stop(&mut self) {
        *self = Journal::default();
    }

    /// Appends recorded since the hold began.
    #[cfg(test)]
    pub(crate) fn appends(&self) -> usize {
        self.marks.len()
    }

    /// Bytes the journal keeps (saved elements, entries, marks).
    pub(crate) fn bytes(&self) -> usize {
        self.saved.len()
            + self.entries.len() * std::mem::size_of::<Entry>()
            + self.marks.len() * std::mem::size_of::<usize>()
    }

    /// Calls `f` with the size of each heap block a copy of the journal allocates.
    pub(crate) fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        f(std::mem::size_of_val(self.marks.as_slice()));
        f(std::mem::size_of_val(self.entries.as_slice()));
        f(self.saved.len());
    }
}

/// Undoes one journal entry on `buf`: puts the saved bytes `old` back from element `at`
/// and truncates to `old_len` elements.
pub(crate) fn restore<T: Pod>(buf: &mut Vec<T>, at: usize, old: &[u8], old_len: usize) {
    let n = old.len() / std::mem::size_of::<T>();
    bytemuck::cast_slice_mut::<T, u8>(&mut buf[at..at + n]).copy_from_slice(old);
    buf.truncate(old_len);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Five appends writing two buffers in overlapping ranges, growing and overwriting:
    /// per append, (buffer, range, value written).
    const WRITES: [&[(u8, Range<usize>, u16)]; 5] = [
        &[(0, 0..3, 1)],
        &[(0, 2..5, 2), (1, 0..2, 3)],
        &[(0, 1..2, 4), (0, 1..4, 5)],
        &[(1, 4..6, 6)],
        &[(0, 0..6, 7), (1, 1..3, 8)],
    ];

    /// One append: its writes through `j`.
    fn apply(j: &mut Journal, bufs: &mut [Vec<u16>; 2], w: &[(u8, Range<usize>, u16)]) {
        j.mark();
        for (f, r, x) in w {
            j.write(*f, 0, &mut bufs[*f as usize], r.clone()).fill(*x);
        }
    }

    /// Two buffers written in overlapping ranges over several appends (growing and
    /// overwriting); releasing at every split point gives back exactly the buffers as
    /// they were after the kept appends, lengths included.
    #[test]
    fn release_restores_every_earlier_state() {
        let writes = WRITES;
        for before in 0..writes.len() {
            for keep in 0..=writes.len() - before + 1 {
                let mut bufs = [Vec::new(), Vec::new()];
                let mut j = Journal::default();
                for w in &writes[..before] {
                    apply(&mut j, &mut bufs, w);
                }
                assert_eq!(j.bytes(), 0, "not holding, nothing kept");
                let mut want = bufs.clone();
                j.hold();
                for (i, w) in writes[before..].iter().enumerate() {
                    apply(&mut j, &mut bufs, w);
                    if i < keep {
                        apply(&mut Journal::default(), &mut want, w);
                    }
                }
                assert_eq!(j.appends(), writes.len() - before);
                j.rewind(keep, |f, h, at, old, len| {
                    assert_eq!(h, 0);
                    restore(&mut bufs[f as usize], at, old, len)
                });
                j.stop();
                assert_eq!(bufs, want, "before={before} keep={keep}");
                assert_eq!(j.bytes(), 0);
            }
        }
    }

    /// Rewinding to every split point and then writing more: the buffers are those of
    /// the kept appends plus the later ones, the journal still holds, and releasing any
    /// number of the appends it now records gives back the buffers after them.
    #[test]
    fn rewind_holds_on() {
        let writes = WRITES;
        fn undo(bufs: &mut [Vec<u16>; 2]) -> impl FnMut(u8, usize, usize, &[u8], usize) + '_ {
            move |f, _, at, old, len| restore(&mut bufs[f as usize], at, old, len)
        }
        for keep in 0..=writes.len() {
            for release in 0..=keep + 2 {
                let mut bufs = [vec![9u16; 2], Vec::new()];
                let mut j = Journal::default();
                j.hold();
                for w in &writes {
                    apply(&mut j, &mut bufs, w);
                }
                j.rewind(keep, undo(&mut bufs));
                assert_eq!(j.appends(), keep);
                // Later appends: the first two writes again.
                for w in &writes[..2] {
                    apply(&mut j, &mut bufs, w);
                }
                let order: Vec<_> = writes[..keep].iter().chain(&writes[..2]).collect();
                let mut want = [vec![9u16; 2], Vec::new()];
                for w in order.iter().take(release) {
                    apply(&mut Journal::default(), &mut want, w);
                }
                j.rewind(release, undo(&mut bufs));
                j.stop();
                assert_eq!(bufs, want, "keep={keep} release={release}");
                assert_eq!(j.bytes(), 0);
            }
        }
    }
}
