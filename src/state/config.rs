//! The cache configuration as a state records it: the settings that decide what a cache
//! holds, resolved (K's and V's precision, whatever flags named them; whether the
//! rotation is on for this head dimension), so two configurations that build the same
//! cache record the same bytes, and a difference names its flag and both values.

use super::{refuse, Problem, Reader, Writer};
use crate::error::Result;
use crate::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use crate::model::WeightsDType;

/// The settings of one cache configuration a state records (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct KvRecord {
    k: Precision,
    v: Precision,
    group_size: usize,
    sink: usize,
    window: Option<usize>,
    positions: PositionsMode,
    residual: usize,
    key_rope: KeyRope,
    rotates: bool,
}

/// Precision codes of the format (docs/design.md §5).
const PRECISIONS: [Precision; 6] = [
    Precision::Fp32,
    Precision::Fp16,
    Precision::Bf16,
    Precision::Int8,
    Precision::Int4,
    Precision::Int2,
];

fn code_of(p: Precision) -> u8 {
    PRECISIONS.iter().position(|&x| x == p).unwrap_or(0) as u8
}

/// Weights dtype codes of the format.
pub(super) fn weights_code(w: WeightsDType) -> u8 {
    match w {
        WeightsDType::Native => 0,
        WeightsDType::F32 => 1,
        WeightsDType::Bf16 => 2,
    }
}

pub(super) fn weights_of(code: u8) -> Result<WeightsDType> {
    match code {
        0 => Ok(WeightsDType::Native),
        1 => Ok(WeightsDType::F32),
        2 => Ok(WeightsDType::Bf16),
        x => Err(refuse(
            Problem::Malformed,
            format!("unknown weights dtype code {x}"),
        )),
    }
}

fn unknown(what: &str, field: &str, x: u8) -> crate::error::Error {
    refuse(
        Problem::Malformed,
        format!("{what}: unknown {field} code {x}"),
    )
}

impl KvRecord {
    /// What `kv` builds in a model of head dimension `head_dim`.
    pub(super) fn of(kv: &KvConfig, head_dim: usize) -> KvRecord {
        KvRecord {
            k: kv.key_precision(),
            v: kv.value_precision(),
            group_size: kv.group_size,
            sink: kv.sink,
            window: kv.window,
            positions: kv.positions,
            residual: kv.residual,
            key_rope: kv.key_rope,
            rotates: kv.rotates(head_dim),
        }
    }

    /// A configuration that records as `self`.
    pub(super) fn config(&self) -> KvConfig {
        KvConfig {
            precision: self.k,
            v_precision: (self.v != self.k).then_some(self.v),
            group_size: self.group_size,
            sink: self.sink,
            window: self.window,
            positions: self.positions,
            residual: self.residual,
            key_rope: self.key_rope,
            rotation: if self.rotates {
                KvRotation::Hadamard
            } else {
                KvRotation::None
            },
            ..KvConfig::default()
        }
    }

    pub(super) fn write(&self, w: &mut Writer) {
        w.put(code_of(self.k));
        w.put(code_of(self.v));
        w.usize(self.group_size);
        w.usize(self.sink);
        // 0: no window (a window is at least 1).
        w.usize(self.window.unwrap_or(0));
        w.put(match self.positions {
            PositionsMode::Original => 0u8,
            PositionsMode::Cache => 1,
        });
        w.usize(self.residual);
        w.put(match self.key_rope {
            KeyRope::Post => 0u8,
            KeyRope::Pre => 1,
        });
        w.put(u8::from(self.rotates));
    }

    pub(super) fn read(r: &mut Reader<'_>, what: &str) -> Result<KvRecord> {
        let f = |field: &'static str| move || format!("{what}: {field}");
        let precision = |r: &mut Reader<'_>, field: &'static str| -> Result<Precision> {
            let x = r.get::<u8>(&f(field))?;
            PRECISIONS
                .get(x as usize)
                .copied()
                .ok_or_else(|| unknown(what, field, x))
        };
        let k = precision(r, "K precision")?;
        let v = precision(r, "V precision")?;
        let group_size = r.usize(usize::MAX, &f("group size"))?;
        let sink = r.usize(usize::MAX, &f("sink"))?;
        let window = Some(r.usize(usize::MAX, &f("window"))?).filter(|&w| w > 0);
        let positions = match r.get::<u8>(&f("positions mode"))? {
            0 => PositionsMode::Original,
            1 => PositionsMode::Cache,
            x => return Err(unknown(what, "positions mode", x)),
        };
        let residual = r.usize(usize::MAX, &f("residual"))?;
        let key_rope = match r.get::<u8>(&f("key RoPE"))? {
            0 => KeyRope::Post,
            1 => KeyRope::Pre,
            x => return Err(unknown(what, "key RoPE", x)),
        };
        let rotates = match r.get::<u8>(&f("rotation"))? {
            0 => false,
            1 => true,
            x => return Err(unknown(what, "rotation", x)),
        };
        Ok(KvRecord {
            k,
            v,
            group_size,
            sink,
            window,
            positions,
            residual,
            key_rope,
            rotates,
        })
    }

    /// Refuses a state recorded as `self` for a run that builds `want`, naming the first
    /// setting that differs by its flag (`prefix`: which layer, or empty).
    pub(super) fn check(&self, want: &KvRecord, prefix: &str) -> Result<()> {
        let window = |w: Option<usize>| w.map_or("none".to_string(), |w| w.to_string());
        let rot = |r: bool| if r { "hadamard" } else { "none" };
        let diffs: [(&str, String, String); 9] = [
            (
                "--kv-quantize-k",
                self.k.name().into(),
                want.k.name().into(),
            ),
            (
                "--kv-quantize-v",
                self.v.name().into(),
                want.v.name().into(),
            ),
            (
                "--kv-group-size",
                self.group_size.to_string(),
                want.group_size.to_string(),
            ),
            (
                "--streaming-llm-sink",
                self.sink.to_string(),
                want.sink.to_string(),
            ),
            (
                "--streaming-llm-window",
                window(self.window),
                window(want.window),
            ),
            (
                "--streaming-llm-positions",
                self.positions.name().into(),
                want.positions.name().into(),
            ),
            (
                "--kv-residual",
                self.residual.to_string(),
                want.residual.to_string(),
            ),
            (
                "--kv-key-rope",
                self.key_rope.name().into(),
                want.key_rope.name().into(),
            ),
            (
                "--kv-rotation",
                rot(self.rotates).into(),
                rot(want.rotates).into(),
            ),
        ];
        match diffs.into_iter().find(|(_, a, b)| a != b) {
            None => Ok(()),
            Some((flag, theirs, ours)) => Err(refuse(
                Problem::Config,
                format!(
                    "{prefix}saved with another cache configuration: {flag} is {theirs} in the state, {ours} in this run"
                ),
            )),
        }
    }
}
