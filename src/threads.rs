//! How many threads a step runs on: the current rayon pool's, or the calling thread alone
//! ([`solo`]); and the adaptive choice between the team ([`crate::relay`]) and one thread
//! for each step ([`Pace`]) and for batches ([`batch`]), by measured step times and by how
//! crowded the machine is ([`crowded`]). Whether a session uses the team or the adaptive
//! choice at all is its options' ([`crate::exec::ExecOptions`]: `--team`, `--adaptive`),
//! passed in; nothing here reads the environment. [`crowded`] reads `/proc/loadavg` and
//! `/proc/self/task/*/stat`: a measurement of the machine, not configuration.
//!
//! Both modes give the same values bit for bit (every product and attention head is
//! computed by the same serial kernels whoever runs it), so every choice made here is a
//! choice of speed only.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

thread_local! {
    /// Set while [`solo`] runs: the calling thread computes alone.
    static SOLO: Cell<bool> = const { Cell::new(false) };
}

/// The threads a parallel region may use here: the current rayon pool's, or 1 inside
/// [`solo`]. The kernels ask this, not rayon, before they split work.
pub fn current() -> usize {
    match SOLO.with(Cell::get) {
        true => 1,
        false => rayon::current_num_threads(),
    }
}

/// Runs `f` with every kernel on the calling thread ([`current`] is 1 inside): the pool's
/// other threads stay asleep.
pub fn solo<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SOLO.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SOLO.with(|s| s.replace(true)));
    f()
}

static CROWD_CHECK: AtomicUsize = AtomicUsize::new(CrowdCheck::Read as usize);

/// What [`crowded`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrowdCheck {
    /// Read the machine's counts (the default).
    Read = 0,
    /// Never crowded (tests that need both modes to run whatever else the machine does).
    Never = 1,
    /// Always crowded (tests of what a crowd changes).
    Always = 2,
}

/// Sets what [`crowded`] answers, for the process.
pub fn set_crowd_check(check: CrowdCheck) {
    CROWD_CHECK.store(check as usize, Ordering::Relaxed);
}

/// How a decode step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every thread of the pool, as a team.
    Team,
    /// The calling thread alone ([`solo`]).
    Solo,
}

/// The adaptive choice between [`Mode::Team`] and [`Mode::Solo`] for one sequence's
/// decode steps: both modes give the same values bit for bit, so the choice is speed only.
///
/// It keeps an exponential average of each mode's step time (weight 1/2 for the newest;
/// a probe's step, below, replaces its mode's older average) and runs the faster one,
/// except that now and then one step (a *probe*) runs the other mode to keep its average
/// current: on a calm machine the team wins; when another process
/// takes a core, a team step waits for its descheduled member and one thread wins, and the
/// probe notices when the core comes back. Step times grow slowly with the context, so two
/// averages taken a few steps apart compare like for like.
///
/// Start: each mode is measured twice before the averages decide alone (a single step can
/// be an outlier): the team first, unless the machine is [`crowded`] just then — then one
/// thread, and the team only as a probe (below).
///
/// Probes are paced by what they cost: the next one runs once the faster mode has run at
/// least [`PROBE_EVERY`] steps since the last and for at least `budget` times the other
/// mode's average step time, where `budget` is [`PROBE_BUDGET`] doubled for each probe in a
/// row that found the other mode still slower (at most [`MAX_BACKOFF`] doublings; a change
/// of the faster mode resets it). A probe then takes at most about 1/`budget` of the time,
/// however much slower the other mode is just now (a team whose member lost its core can
/// take several one-thread steps' time), and a steady state costs less and less.
///
/// A probe of the team that falls due while the machine is [`crowded`] (another process
/// holds the core a member needs, so the probe would only measure that) waits for a step
/// where it is not, or for [`CROWDED_WAIT`] times its budget, whichever comes first; and a
/// team measured while crowded is tried again as soon as the crowd has gone (at most once
/// in [`PROBE_EVERY`] steps), its crowded average forgotten. (That is for a team that
/// waits for a late member. The engine's team, the relay ([`crate::relay`]), takes a late
/// member's work over instead, so `Model::forward` answers "not crowded": the relay is
/// probed as paced above and chosen when faster, crowded or not.)
#[derive(Debug, Clone, Default)]
pub struct Pace {
    /// steps run in each mode: team, solo
    runs: [u64; 2],
    /// each mode's average step time in seconds: team, solo
    avg: [Option<f64>; 2],
    /// steps, and their seconds, run in the faster mode since the last probe
    since_probe: (u64, f64),
    /// probes in a row that found the other mode still slower
    misses: u32,
    /// the team's last step ran while the machine was [`crowded`]
    team_crowded: bool,
}

/// A probe runs at most once in this many steps.
pub const PROBE_EVERY: u64 = 16;

/// A probe runs only after the faster mode has run this many times the probed mode's
/// average step time since the last probe (before any doubling, see [`Pace`]).
pub const PROBE_BUDGET: f64 = 16.0;

/// The most times the probe budget doubles while probes keep finding the same mode faster.
pub const MAX_BACKOFF: u32 = 2;

/// A due probe of the team waits at most this many times its budget for the machine to
/// stop being [`crowded`].
pub const CROWDED_WAIT: f64 = 8.0;

/// A mode is measured this many times before the averages alone decide.
const FIRST_RUNS: u64 = 2;

impl Mode {
    fn index(self) -> usize {
        (self == Mode::Solo) as usize
    }

    fn other(self) -> Mode {
        match self {
            Mode::Team => Mode::Solo,
            Mode::Solo => Mode::Team,
        }
    }
}

impl Pace {
    /// The faster mode by the averages (the only measured one if one is).
    fn faster(&self) -> Option<Mode> {
        match self.avg {
            [Some(t), Some(s)] if t <= s => Some(Mode::Team),
            [Some(_), Some(_)] | [None, Some(_)] => Some(Mode::Solo),
            [Some(_), None] => Some(Mode::Team),
            [None, None] => None,
        }
    }

    /// The mode of the next step. `crowded` is asked (at most once) when the step could
    /// be a probe of the team: whether other processes now hold a core a member needs
    /// ([`crowded`]).
    pub fn next(&mut self, crowded: impl FnOnce() -> bool) -> Mode {
        let Some(best) = self.faster() else {
            self.team_crowded = crowded();
            return match self.team_crowded {
                true => Mode::Solo,
                false => Mode::Team,
            };
        };
        let other = best.other();
        let (steps, secs) = self.since_probe;
        // The probed mode's average step time (or, never measured, the faster mode's).
        let cost = self.avg[other.index()]
            .or(self.avg[best.index()])
            .unwrap_or(0.0);
        let budget = PROBE_BUDGET * f64::from(1u32 << self.misses.min(MAX_BACKOFF));
        let spent = |budget: f64| steps >= PROBE_EVERY && secs >= budget * cost;
        let due = self.runs[other.index()] < FIRST_RUNS || spent(budget);
        match other {
            Mode::Solo if due => Mode::Solo,
            Mode::Solo => best,
            // The team's last measure was taken crowded: try it as soon as the crowd
            // has gone.
            Mode::Team if due || (self.team_crowded && steps >= PROBE_EVERY) => {
                let now = crowded();
                match spent(CROWDED_WAIT * budget) || !now {
                    true => {
                        if self.team_crowded && !now {
                            // Measured in a crowd, the average says nothing of now.
                            self.avg[Mode::Team.index()] = None;
                        }
                        self.team_crowded = now;
                        Mode::Team
                    }
                    false => best,
                }
            }
            Mode::Team => best,
        }
    }

    /// Records how long a step in `mode` took.
    pub fn record(&mut self, mode: Mode, took: Duration) {
        let i = mode.index();
        let before = self.faster();
        let measured = self.runs[i] >= FIRST_RUNS;
        self.runs[i] += 1;
        let t = took.as_secs_f64();
        // A probe's step replaces its mode's average, which is at least PROBE_EVERY steps
        // old: one slow step then (a member descheduled just then) does not hold the mode
        // back for probe after probe.
        let probe = measured && before.is_some_and(|b| b != mode);
        self.avg[i] = Some(match self.avg[i] {
            Some(a) if !probe => 0.5 * (a + t),
            _ => t,
        });
        let after = self.faster();
        match before {
            // The faster mode changed (by a probe or by its own steps): probe at the
            // first pace again.
            Some(best) if after != Some(best) => {
                self.since_probe = (0, 0.0);
                self.misses = 0;
            }
            Some(best) if best != mode => {
                self.since_probe = (0, 0.0);
                if measured {
                    self.misses = self.misses.saturating_add(1);
                }
            }
            Some(_) => self.since_probe = (self.since_probe.0 + 1, self.since_probe.1 + t),
            None => {}
        }
    }
}

/// Whether other processes' runnable threads leave fewer idle cores than a team of `n`
/// threads needs just now: `cores − others < n`, where `others` is the kernel's count of
/// runnable threads at this instant (Linux: `/proc/loadavg`'s fourth field,
/// `running/total`) less this process's own runnable threads (`/proc/self/task/*/stat`,
/// state `R`: the calling thread, and a pool worker still spinning after a parallel
/// region, are not a crowd). The own count is read before and after the global one and the
/// larger is taken, so a worker that falls asleep in between is not counted as another
/// process. The cores are [`std::thread::available_parallelism`]. `false` where the counts
/// cannot be read (other systems), or after [`set_crowd_check`]`(CrowdCheck::Never)`: then
/// team probes run when due, paced as above, and batches run on the whole pool.
pub fn crowded(n: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        match CROWD_CHECK.load(Ordering::Relaxed) {
            c if c == CrowdCheck::Never as usize => return false,
            c if c == CrowdCheck::Always as usize => return true,
            _ => {}
        }
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let crowd =
            |running: usize, own: usize| cores.saturating_sub(running - own.min(running)) < n;
        // Counting only the caller as ours is the cheap first look; the own threads are
        // read (before and after a second global count) only when that says crowded.
        if !running_threads().is_some_and(|r| crowd(r, 1)) {
            return false;
        }
        let own_before = own_running();
        let Some(running) = running_threads() else {
            return false;
        };
        crowd(running, own_before.max(own_running()).max(1))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = n;
        CROWD_CHECK.load(Ordering::Relaxed) == CrowdCheck::Always as usize
    }
}

/// The kernel's count of runnable threads now (`/proc/loadavg`'s `running/total`).
#[cfg(target_os = "linux")]
fn running_threads() -> Option<usize> {
    let line = std::fs::read_to_string("/proc/loadavg").ok()?;
    line.split_whitespace()
        .nth(3)?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// This process's threads in state `R` (running or runnable), by `/proc/self/task`; 1 (the
/// caller) where that cannot be read.
#[cfg(target_os = "linux")]
fn own_running() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 1;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter(|stat| {
            // `pid (comm) state ...`: the name may hold spaces and parentheses, the
            // state follows the last `)`.
            stat.rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                == Some("R")
        })
        .count()
}

/// Runs `f` (a batch: a prefill chunk, or a step of several sequences) on the calling
/// thread alone ([`solo`]) when the adaptive choice is on (`adaptive`: the session's
/// [`crate::exec::ExecOptions::adaptive`]), the pool has
/// more than one thread and the machine is [`crowded`] just now: a product split between
/// two threads waits for the one whose core another process holds, and one thread is
/// faster. Otherwise `f` runs on the whole pool. Same values either way.
pub fn batch<R>(adaptive: bool, f: impl FnOnce() -> R) -> R {
    let n = current();
    if n > 1 && adaptive && crowded(n) {
        ALONE_BATCHES.fetch_add(1, Ordering::Relaxed);
        solo(f)
    } else {
        f()
    }
}

static ALONE_BATCHES: AtomicUsize = AtomicUsize::new(0);

/// Batches that [`batch`] ran on one thread because the machine was crowded, since the
/// process started.
pub fn alone_batches() -> usize {
    ALONE_BATCHES.load(Ordering::Relaxed)
}

impl Pace {
    /// Steps run so far as a team and alone.
    pub fn runs(&self) -> (u64, u64) {
        (self.runs[0], self.runs[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Feeds `pace` steps whose time is `team` / `solo` microseconds by mode, the machine
    /// `crowded` or not; returns the modes chosen.
    fn feed(pace: &mut Pace, steps: usize, team: u64, solo: u64, crowded: bool) -> Vec<Mode> {
        (0..steps)
            .map(|_| {
                let m = pace.next(|| crowded);
                let us = if m == Mode::Team { team } else { solo };
                pace.record(m, Duration::from_micros(us));
                m
            })
            .collect()
    }

    /// Modes `m` in `modes` and their share of the time, steps costing `team` / `solo`.
    fn share(modes: &[Mode], m: Mode, team: u64, solo: u64) -> (usize, f64) {
        let cost = |x: &Mode| if *x == Mode::Team { team } else { solo } as f64;
        let n = modes.iter().filter(|&&x| x == m).count();
        let part: f64 = modes.iter().filter(|&&x| x == m).map(cost).sum();
        (n, part / modes.iter().map(cost).sum::<f64>())
    }

    #[test]
    fn pace_measures_both_then_runs_the_faster_and_probes_the_other() {
        let mut p = Pace::default();
        let first = feed(&mut p, 4, 100, 300, false);
        assert_eq!(first, [Mode::Team, Mode::Solo, Mode::Solo, Mode::Team]);
        // Calm: the team runs; solo probes keep coming, ever rarer (the budget doubles
        // twice: 16, 32, 64 times 300 µs of team steps), in at most 1/16 of the time.
        let calm = feed(&mut p, 800, 100, 300, false);
        let (probes, time) = share(&calm, Mode::Solo, 100, 300);
        assert!((4..=8).contains(&probes), "{probes} probes: {calm:?}");
        assert!(time <= 1.0 / PROBE_BUDGET, "probe share {time}");
        let gaps: Vec<usize> = calm
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == Mode::Solo)
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect();
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "gaps {gaps:?}");
        assert!(
            gaps.last().is_some_and(|&g| g >= 150),
            "no backoff: {gaps:?}"
        );
        // The machine gets busy (not seen as crowded): team steps now take 500 µs; the
        // pace turns to one thread at once and probes the team in at most 1/16 of the time.
        let busy = feed(&mut p, 800, 500, 300, false);
        let first_solo = busy.iter().position(|&m| m == Mode::Solo).expect("solo");
        assert!(
            first_solo <= 2,
            "still the team at step {first_solo}: {busy:?}"
        );
        let (n, time) = share(&busy[3..], Mode::Team, 500, 300);
        assert!(n >= 3, "the team was probed {n} times: {busy:?}");
        assert!(time <= 1.0 / PROBE_BUDGET, "probe share {time}");
        // Calm again: a team probe brings the team back (within the longest budget,
        // 64 · 500 µs of solo steps), then only solo probes run alone.
        let again = feed(&mut p, 800, 100, 300, false);
        let back = again
            .windows(4)
            .position(|w| w.iter().all(|&m| m == Mode::Team));
        assert!(
            back.is_some_and(|b| b <= 110),
            "team back at {back:?}: {again:?}"
        );
        let (_, time) = share(&again[200..], Mode::Solo, 100, 300);
        assert!(time <= 1.0 / PROBE_BUDGET, "probe share {time}");
        let (t, s) = p.runs();
        assert_eq!(t + s, 2404);
    }

    #[test]
    fn a_much_slower_mode_is_probed_rarely() {
        // One thread 8.5 ms, a team step 20 ms (one busy process on two cores, not seen
        // as crowded): after the start, the team runs at most 1/16 of the time, and
        // still now and then.
        let mut p = Pace::default();
        let modes = feed(&mut p, 1000, 20_000, 8_500, false);
        assert_eq!(modes[..4], [Mode::Team, Mode::Solo, Mode::Team, Mode::Solo]);
        let (n, time) = share(&modes[4..], Mode::Team, 20_000, 8_500);
        assert!(time <= 1.0 / PROBE_BUDGET, "{n} team steps, share {time}");
        assert!(n >= 3, "the team was never probed again: {n}");
    }

    #[test]
    fn one_probe_brings_back_a_mode_whose_old_average_was_slow() {
        // The team measured slow (a member lost its core), then as fast as it is again:
        // the first probe's step replaces the old average, so the team is back after one
        // probe, not after the several an average of old and new would need (step 2,153
        // here when it averaged).
        let mut p = Pace::default();
        feed(&mut p, 2000, 5_000, 300, false);
        let modes = feed(&mut p, 3000, 200, 300, false);
        let back = modes
            .windows(4)
            .position(|w| w.iter().all(|&m| m == Mode::Team));
        assert!(back.is_some_and(|b| b < 1_200), "team back at {back:?}");
        let (_, time) = share(&modes[1_200..], Mode::Solo, 200, 300);
        assert!(time <= 1.0 / PROBE_BUDGET, "probe share {time}");
    }

    #[test]
    fn a_crowded_machine_delays_team_probes() {
        // Crowded from the start: one thread runs, and the team is first tried only
        // after CROWDED_WAIT times the probe budget of one-thread time.
        let mut p = Pace::default();
        let modes = feed(&mut p, 3000, 20_000, 8_500, true);
        let first_team = modes.iter().position(|&m| m == Mode::Team);
        let wait = (CROWDED_WAIT * PROBE_BUDGET) as usize;
        assert!(
            first_team.is_some_and(|t| (wait..wait + 8).contains(&t)),
            "first team step {first_team:?}"
        );
        let (n, time) = share(&modes, Mode::Team, 20_000, 8_500);
        assert!(n >= 3, "the team was tried {n} times");
        assert!(
            time <= 1.0 / (CROWDED_WAIT * PROBE_BUDGET),
            "team share {time}"
        );
        // The crowd leaves: the team is tried within PROBE_EVERY steps and wins.
        let calm = feed(&mut p, 300, 5_000, 8_500, false);
        let back = calm
            .windows(4)
            .position(|w| w.iter().all(|&m| m == Mode::Team));
        assert!(
            back.is_some_and(|b| b as u64 <= PROBE_EVERY),
            "team back at {back:?}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn own_running_counts_a_spinning_thread_of_ours() {
        let stop = AtomicBool::new(false);
        let started = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                started.store(true, Ordering::SeqCst);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            while !started.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
            // The caller and the spinner are running or runnable (other tests' threads
            // may add more).
            let n = own_running();
            stop.store(true, Ordering::Relaxed);
            assert!(n >= 2, "{n}");
        });
    }

    #[test]
    fn crowded_reads_the_running_count() {
        // An empty team needs no core; a team far larger than the machine always lacks
        // some (where the count can be read).
        assert!(!crowded(0));
        if std::fs::read_to_string("/proc/loadavg").is_ok() {
            assert!(crowded(4096));
        }
    }
}
