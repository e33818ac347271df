//! The stored-row probe (issue 24): runs the engine and the reference side by side, one
//! token at a time, and after every step compares, layer by layer, the K and V rows each
//! appended (as they arrived, before any cast or quantisation) and every row each cache
//! holds (as attention reads it, dequantised). It reports the first difference of each
//! kind, so that a difference in the stored rows can be traced to its cause: a last-bit
//! difference in the f32 rows that then lands a code on the other side of a boundary, or
//! a difference of the quantiser itself (equal inputs, different codes).
#![allow(dead_code, clippy::needless_range_loop)]

use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::Model;
use tinygpt_reference::quant::{Affine, Bits};

/// One differing element.
#[derive(Debug, Clone)]
pub struct ElemDiff {
    /// Step (the token index being run).
    pub step: usize,
    pub layer: usize,
    /// 'K' or 'V'.
    pub side: char,
    /// Absolute position of the row.
    pub pos: usize,
    /// Element of the row (`kv_head · head_dim + channel`).
    pub elem: usize,
    pub engine: f32,
    pub reference: f32,
    /// The f32 values each side appended for this element, before any quantisation.
    pub engine_in: f32,
    pub reference_in: f32,
    /// For a per-token (V) KIVI row: the codes each side's input gets from the
    /// quantiser of docs/design.md §2.3, fitted on each side's own head slice.
    pub codes: Option<(i32, i32)>,
    /// For that V row: where each side's input falls in code units,
    /// `(x − zero) / scale + qmin` with each side's own parameters (a boundary is at
    /// `k + 0.5`).
    pub code_units: Option<(f32, f32)>,
}

impl std::fmt::Display for ElemDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {} layer {} {} pos {} elem {}: engine {:e} ({:#010x}) reference {:e} ({:#010x}); inputs engine {:e} reference {:e} ({} ulp apart)",
            self.step,
            self.layer,
            self.side,
            self.pos,
            self.elem,
            self.engine,
            self.engine.to_bits(),
            self.reference,
            self.reference.to_bits(),
            self.engine_in,
            self.reference_in,
            ulps(self.engine_in, self.reference_in)
        )?;
        if let Some((e, r)) = self.codes {
            write!(f, "; codes engine {e} reference {r}")?;
        }
        if let Some((e, r)) = self.code_units {
            write!(f, " (code units engine {e:.7}, reference {r:.7})")?;
        }
        Ok(())
    }
}

/// Distance in units in the last place between two finite f32 (across zero too: the
/// representable values between them, plus one).
pub fn ulps(a: f32, b: f32) -> i64 {
    let ord = |x: f32| {
        let b = x.to_bits();
        if b >> 31 == 1 {
            -((b & 0x7fff_ffff) as i64)
        } else {
            b as i64
        }
    };
    (ord(a) - ord(b)).abs()
}

/// What the probe found over a run.
#[derive(Debug, Default)]
pub struct ProbeReport {
    /// The first appended (pre-quantisation) element that differs.
    pub first_input: Option<ElemDiff>,
    /// The first stored (as read back) element that differs.
    pub first_stored: Option<ElemDiff>,
    /// The first stored element of a quantised row that differs.
    pub first_flip: Option<ElemDiff>,
    /// Stored rows (layer, position, side) that hold at least one differing code at the
    /// step of the first flip.
    pub flips_at_first_flip_step: usize,
    /// Stored elements that differ although both sides appended bit-identical rows for
    /// them (and for the whole group or head slice they were quantised with): a
    /// quantiser or storage difference, not an order one.
    pub same_input_stored_diffs: usize,
    /// Over all steps and layers: appended elements compared and differing.
    pub inputs_compared: usize,
    pub inputs_differing: usize,
    /// Stored elements compared and differing, and those of them in quantised rows
    /// (a different code or different parameters, not a last-bit difference).
    pub stored_compared: usize,
    pub stored_differing: usize,
    pub stored_flips: usize,
    /// Largest ulp distance between appended inputs.
    pub max_input_ulps: i64,
}

impl std::fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "inputs: {} of {} appended elements differ (max {} ulp)",
            self.inputs_differing, self.inputs_compared, self.max_input_ulps
        )?;
        writeln!(
            f,
            "stored: {} of {} stored element reads differ, {} of them in quantised rows; {} with identical inputs",
            self.stored_differing, self.stored_compared, self.stored_flips, self.same_input_stored_diffs
        )?;
        match &self.first_input {
            Some(d) => writeln!(f, "first input difference:  {d}")?,
            None => writeln!(f, "first input difference:  none")?,
        }
        match &self.first_stored {
            Some(d) => writeln!(f, "first stored difference: {d}")?,
            None => writeln!(f, "first stored difference: none")?,
        }
        match &self.first_flip {
            Some(d) => write!(
                f,
                "first code flip:         {d}; {} flipped elements at that step",
                self.flips_at_first_flip_step
            ),
            None => write!(f, "first code flip:         none"),
        }
    }
}

/// Runs `toks` (position = index) through both implementations with cache `kv` and
/// compares their K/V after every step, for every layer that holds K/V.
pub fn probe(
    engine: &Model,
    reference: &tinygpt_reference::Model,
    kv: &KvConfig,
    toks: &[u32],
) -> ProbeReport {
    let cfg = &reference.cfg;
    let layers = cfg.layers_with_kv();
    let hd = cfg.head_dim;
    let mut session = engine.session(kv);
    for l in 0..layers {
        session.cache.layer_mut(l).probe_appends();
    }
    let mut state = tinygpt_reference::State::new(cfg, kv);
    // Inputs by layer and position: (engine k, engine v, reference k, reference v).
    type Rows = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
    let mut inputs: Vec<Vec<Rows>> = vec![Vec::new(); layers];
    let mut rep = ProbeReport::default();
    for (step, &t) in toks.iter().enumerate() {
        engine
            .forward(&mut session, t, step)
            .expect("engine forward");
        reference.forward(&mut state, t, step);
        for l in 0..layers {
            let el = session.cache.layer(l);
            let rl = &state.caches[l];
            let (ek, ev) = el.last_appended().expect("probe on");
            let (rk, rv) = rl.last_appended();
            for (side, e, r) in [('K', ek, rk), ('V', ev, rv)] {
                for (i, (&a, &b)) in e.iter().zip(r).enumerate() {
                    rep.inputs_compared += 1;
                    if a.to_bits() != b.to_bits() {
                        rep.inputs_differing += 1;
                        rep.max_input_ulps = rep.max_input_ulps.max(ulps(a, b));
                        if rep.first_input.is_none() {
                            rep.first_input = Some(ElemDiff {
                                step,
                                layer: l,
                                side,
                                pos: step,
                                elem: i,
                                engine: a,
                                reference: b,
                                engine_in: a,
                                reference_in: b,
                                codes: None,
                                code_units: None,
                            });
                        }
                    }
                }
            }
            inputs[l].push((ek.to_vec(), ev.to_vec(), rk.to_vec(), rv.to_vec()));
            assert_eq!(el.len(), rl.len(), "step {step} layer {l}: stored rows");
            let positions: Vec<usize> = (0..rl.len()).map(|i| rl.position(i)).collect();
            assert_eq!(
                el.positions(),
                positions,
                "step {step} layer {l}: positions"
            );
            for (i, &pos) in positions.iter().enumerate() {
                let inp = &inputs[l][pos];
                for (side, e, r, e_in, r_in) in [
                    ('K', el.key(i), rl.key(i), &inp.0, &inp.2),
                    ('V', el.value(i), rl.value(i), &inp.1, &inp.3),
                ] {
                    for (j, (&a, &b)) in e.iter().zip(&r).enumerate() {
                        rep.stored_compared += 1;
                        if a.to_bits() == b.to_bits() {
                            continue;
                        }
                        rep.stored_differing += 1;
                        let flip = quantised(kv, side, pos, step);
                        if flip {
                            rep.stored_flips += 1;
                        }
                        // Identical inputs for everything this element was quantised with:
                        // the V head slice of its row, or the K channel over the stored rows.
                        let same_inputs = match side {
                            'V' => {
                                let h = j / hd * hd;
                                e_in[h..h + hd] == r_in[h..h + hd]
                            }
                            _ => positions
                                .iter()
                                .all(|&p| inputs[l][p].0[j] == inputs[l][p].2[j]),
                        };
                        if same_inputs {
                            rep.same_input_stored_diffs += 1;
                        }
                        let first_flip_step = rep.first_flip.as_ref().map(|d| d.step);
                        if flip && first_flip_step == Some(step) {
                            rep.flips_at_first_flip_step += 1;
                        }
                        if rep.first_stored.is_none() || (flip && first_flip_step.is_none()) {
                            let bits = kv.value_precision().kivi_bits().filter(|_| side == 'V');
                            let h = j / hd * hd;
                            let codes = bits.map(|bits| {
                                let code = |x: &[f32]| -> i32 {
                                    Affine::fit(&x[h..h + hd], bits).quantize(x[j], bits)
                                };
                                (code(e_in), code(r_in))
                            });
                            let code_units = bits.map(|bits| {
                                let unit = |x: &[f32]| -> f32 {
                                    let a = Affine::fit(&x[h..h + hd], bits);
                                    (x[j] - a.zero.to_f32()) / a.scale.to_f32() + bits.qmin() as f32
                                };
                                (unit(e_in), unit(r_in))
                            });
                            let d = ElemDiff {
                                step,
                                layer: l,
                                side,
                                pos,
                                elem: j,
                                engine: a,
                                reference: b,
                                engine_in: e_in[j],
                                reference_in: r_in[j],
                                codes,
                                code_units,
                            };
                            if flip && rep.first_flip.is_none() {
                                rep.first_flip = Some(d.clone());
                                rep.flips_at_first_flip_step = 1;
                            }
                            if rep.first_stored.is_none() {
                                rep.first_stored = Some(d);
                            }
                        }
                    }
                }
            }
        }
    }
    rep
}

/// Whether `side`'s row at `pos` is held as KIVI codes after step `step` (R = 0 or more,
/// prefix `P`, K groups of `G` from the end of the prefix; docs/design.md §2.3).
pub fn quantised(kv: &KvConfig, side: char, pos: usize, step: usize) -> bool {
    let p = kv.full_precision_rows();
    if bits_of(kv, side).is_none() || pos < p || step < kv.residual {
        return false;
    }
    let last_out = step - kv.residual;
    match side {
        'V' => pos <= last_out,
        _ => {
            let g = (pos - p) / kv.group_size;
            p + (g + 1) * kv.group_size - 1 <= last_out
        }
    }
}

/// The KIVI width of a side, for callers that print codes.
pub fn bits_of(kv: &KvConfig, side: char) -> Option<Bits> {
    match side {
        'K' => kv.key_precision().kivi_bits(),
        _ => kv.value_precision().kivi_bits(),
    }
}
