//! A cache's contents as bytes and back (saved states: [`crate::state`], docs/design.md §5):
//! per layer the policy's counter (rows appended), the positions of the prefix and body
//! slots, then the four stores (prefix K, prefix V, body K, body V), each writing its
//! buffers exactly as held ([`RowStore::save`](super::storage::RowStore::save)).
//!
//! Loading starts from a cache fresh from the same configuration (so every setting a
//! store derives from it is the configuration's, never the file's), sets the policy's
//! counter, and lets each store read and check its buffers against the rows the policy
//! says are stored ([`RowStore::load`](super::storage::RowStore::load)). The result is
//! bit for bit the saved cache: every buffer, slot, group and residual row, so later
//! appends and attention behave exactly as they would have in the saved one.

use super::{region, EvictionPolicy, KvCache, LayerKv, StreamingLlm};
use crate::error::Result;
use crate::state::{refuse, Problem, Reader, Writer};
use std::ops::Range;

impl LayerKv<StreamingLlm> {
    /// Writes the layer: rows appended, slot positions, then the four stores.
    pub(crate) fn save_state(&self, w: &mut Writer) {
        w.usize(self.policy.appended());
        w.usizes(&self.prefix_pos);
        w.usizes(&self.body_pos);
        self.prefix_k.save(w);
        self.prefix_v.save(w);
        self.body_k.save(w);
        self.body_v.save(w);
    }

    /// Stored rows as runs of consecutive slots: `(prefix rows, body rows)` (region rows).
    fn stored_runs(&self) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let (mut pre, mut body) = (Vec::new(), Vec::new());
        self.for_each_span(|_, in_prefix, rows| {
            if in_prefix { &mut pre } else { &mut body }.push(rows)
        });
        (pre, body)
    }

    /// Reads what [`save_state`](Self::save_state) wrote into this layer, fresh from the
    /// same configuration; `appended`: the rows the state says every layer appended.
    pub(crate) fn load_state(
        &mut self,
        r: &mut Reader<'_>,
        appended: usize,
        what: &str,
    ) -> Result<()> {
        debug_assert!(self.held.is_none() && self.policy.appended() == 0);
        let t = r.usize(usize::MAX, &|| format!("{what}: rows appended"))?;
        if t != appended {
            return Err(refuse(
                Problem::Inconsistent,
                format!("{what} appended {t} rows but the state holds {appended} token ids"),
            ));
        }
        self.policy.set_appended(t);
        let (pre_rows, body_rows) = self.stored_runs();
        let p = self.prefix;
        let pre = region(&self.policy, 0, p);
        let body = region(&self.policy, p, usize::MAX);
        let body_max = match self.policy.body_slots() {
            Some(m) => m.min(body.appended()),
            None => body.appended(),
        };
        for (pos, at, rows, max, name) in [
            (
                &mut self.prefix_pos,
                &pre,
                &pre_rows,
                pre.appended(),
                "prefix",
            ),
            (&mut self.body_pos, &body, &body_rows, body_max, "body"),
        ] {
            let need = super::storage::slots_needed(at, rows);
            let what = || format!("{what} {name} positions");
            let v = r.usizes(max, &what)?;
            if v.len() < need {
                return Err(refuse(
                    Problem::Inconsistent,
                    format!(
                        "{} hold {} slots, the stored rows need {need}",
                        what(),
                        v.len()
                    ),
                ));
            }
            *pos = v;
        }
        self.prefix_k
            .load(r, &pre, &pre_rows, &format!("{what} prefix K"))?;
        self.prefix_v
            .load(r, &pre, &pre_rows, &format!("{what} prefix V"))?;
        self.body_k
            .load(r, &body, &body_rows, &format!("{what} body K"))?;
        self.body_v
            .load(r, &body, &body_rows, &format!("{what} body V"))?;
        Ok(())
    }
}

impl KvCache {
    /// Whether any layer is holding rows ([`KvCache::hold`]).
    pub(crate) fn holding(&self) -> bool {
        self.layers.iter().any(|l| l.held().is_some())
    }

    /// Writes every layer ([`LayerKv::save_state`]), after their count.
    pub(crate) fn save_state(&self, w: &mut Writer) {
        w.put(self.layers.len() as u32);
        self.layers.iter().for_each(|l| l.save_state(w));
    }

    /// Reads what [`save_state`](Self::save_state) wrote into this cache, fresh from the
    /// same configuration; every layer must have appended `appended` rows.
    pub(crate) fn load_state(&mut self, r: &mut Reader<'_>, appended: usize) -> Result<()> {
        let n = r.get::<u32>(&|| "the layer count".into())? as usize;
        if n != self.layers.len() {
            return Err(refuse(
                Problem::Inconsistent,
                format!(
                    "the state holds {n} cache layers, this model's cache has {}",
                    self.layers.len()
                ),
            ));
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.load_state(r, appended, &format!("layer {l}"))?;
        }
        Ok(())
    }
}
