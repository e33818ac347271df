//! A relay decode team: the threads of a team share one token's step without barriers,
//! so a member that loses its core to another process holds the others up only briefly.
//!
//! Every member runs the whole step program ([`crate::model`]'s `Model::step`); each of
//! its stages is one or more *phases*, numbered from 1 in program order, and a shared
//! counter says which phase is current. A member whose own count is behind the counter
//! skips (another member did that work), so a member that was descheduled catches up
//! without anyone waiting for it.
//!
//! * A *serial* phase ([`Seat::solo`]: norms, residual adds, the K/V append) is run by the
//!   first member to claim it; the others wait until it ends (microseconds).
//! * A *chunked* phase ([`Seat::chunks`]: products, attention) is cut into items. A member
//!   claims an item by a compare-and-swap of its state word (tagged with the phase),
//!   computes it into its own buffers, and publishes it (copies it into the shared output)
//!   only if its claim still stands. Once nothing is left to claim, a member takes over an
//!   item another member claimed but has not published in time ([`grace`]): it recomputes it,
//!   and the late member's result is dropped. Whoever sees every item published opens the
//!   next phase. Items are computed by the same serial kernels whoever runs them, so the
//!   values do not depend on the team.
//! * A chunked phase's input vector is sent through one of [`Relay`]'s two atomic input
//!   buffers (a sequence lock on the phase counter): a late member copies it and drops the
//!   copy if the phase moved meanwhile. A serial phase sends into one; a product's items
//!   can be published straight into the other, as the next product's input.
//! * A late member may still be computing an item of a phase that has ended, so whatever
//!   an item reads must stay as it is until the step ends, not only until its phase does
//!   (the engine gives each layer its own attention scratch, and appends only to the
//!   layer whose phase it is: `model/relay_step.rs`), and no member waits for a late
//!   reader inside the step.
//!
//! The caller of [`run`] is member 0; the others are helper threads that outlive the call
//! (a rayon broadcast per token would make every token wait for its slowest member at
//! the end: `benches/team_designs.rs`). [`run`] returns only when every member has left
//! the step program, also when a member panics (the relay is poisoned, every member
//! panics at its next wait, and the caller re-panics).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{
    fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a claimed item may stay unpublished before another member takes it over, on
/// top of what computing it takes ([`grace`]).
const GRACE: Duration = Duration::from_micros(20);
/// How long a waiting member spins before it yields its core between looks.
const SPIN: Duration = Duration::from_micros(50);
/// How long an idle helper looks for work before it parks.
const IDLE: Duration = Duration::from_millis(2);

static STRESS: AtomicBool = AtomicBool::new(false);
static TAKEN_OVER: AtomicUsize = AtomicUsize::new(0);

/// Tests: makes members late on purpose (a member sleeps 20–200 µs before publishing about
/// one item in four, and before about one serial phase in eight it wins) and takes claimed
/// items over without grace, so take-overs, skipped phases and late publishers happen on
/// every step.
pub fn set_stress(on: bool) {
    STRESS.store(on, Ordering::Relaxed);
}

/// Items taken over since the process started (every relay step).
pub fn taken_over_total() -> usize {
    TAKEN_OVER.load(Ordering::Relaxed)
}

/// Item states: `phase << 8 | state`; a tag older than the phase reads as free.
const PUBLISHING: u64 = 1;
const DONE: u64 = 2;
/// Claimed by member `id`: `CLAIMED + id`.
const CLAIMED: u64 = 16;

fn tag(phase: u64, state: u64) -> u64 {
    phase << 8 | state
}

/// The shared state of one step.
pub struct Relay {
    /// the current phase
    cur: AtomicU64,
    /// the highest serial phase claimed
    solo: AtomicU64,
    states: Vec<AtomicU64>,
    /// two input buffers ([`Seat::send`])
    input: [Vec<AtomicU32>; 2],
    failed: AtomicBool,
    poisoned: AtomicBool,
}

impl Relay {
    /// A step whose chunked phases have at most `items` items and whose inputs at most
    /// `width` values.
    pub fn new(items: usize, width: usize) -> Relay {
        Relay {
            cur: AtomicU64::new(1),
            solo: AtomicU64::new(0),
            states: (0..items).map(|_| AtomicU64::new(0)).collect(),
            input: [0, 1].map(|_| (0..width).map(|_| AtomicU32::new(0)).collect()),
            failed: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
        }
    }

    /// Whether a serial phase failed ([`Seat::fail`]): the step's error is the failing
    /// member's.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

/// Which part of an item [`Seat::chunks`] asks the work function for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Compute the item into the member's own buffers.
    Compute,
    /// The claim still stands: copy the result into the shared output.
    Publish,
}

/// Writes chunked phases' inputs into a [`Relay`]'s input buffers.
#[derive(Clone, Copy)]
pub struct Sender<'r>(&'r Relay);

impl Sender<'_> {
    /// Writes `v` at `at` of input buffer `buf` (0 or 1), for a later chunked phase: inside
    /// [`Seat::solo`], or publishing an item ([`Part::Publish`]) into the buffer the next
    /// product reads, which must not be the one the publishing phase reads.
    pub fn send(self, buf: usize, at: usize, v: &[f32]) {
        // Ordered after this phase's start, which a late reader's check will see.
        fence(Ordering::Release);
        for (a, x) in self.0.input[buf][at..].iter().zip(v) {
            a.store(x.to_bits(), Ordering::Relaxed);
        }
    }
}

/// One member's place in a [`Relay`]: its index, the team's size and its phase count.
pub struct Seat<'r> {
    r: &'r Relay,
    pub id: usize,
    pub n: usize,
    /// the phase this member's program is at
    p: u64,
    /// this phase's input, as copied
    input: Vec<f32>,
    /// [`set_stress`]'s random state
    rng: u64,
}

impl<'r> Seat<'r> {
    pub fn new(r: &'r Relay, id: usize, n: usize) -> Seat<'r> {
        Seat {
            r,
            id,
            n,
            p: 0,
            input: Vec::new(),
            rng: 0x9e37_79b9_7f4a_7c15 ^ (id as u64 + 1),
        }
    }

    /// The program's next phase, if this member is to take part in it (it is current, and
    /// no serial phase failed).
    fn next(&mut self) -> Option<u64> {
        self.p += 1;
        let p = self.p;
        if self.r.failed.load(Ordering::Acquire) || self.r.cur.load(Ordering::Acquire) > p {
            return None;
        }
        Some(p)
    }

    /// Spins, then yields, until `done()`; panics if the relay is poisoned.
    fn wait_until(&self, mut done: impl FnMut() -> bool) {
        let since = Instant::now();
        let mut looks = 0u32;
        while !done() {
            if self.r.poisoned.load(Ordering::Relaxed) {
                panic!("a relay team member panicked");
            }
            looks = looks.wrapping_add(1);
            match looks.is_multiple_of(64) && since.elapsed() > SPIN {
                true => std::thread::yield_now(),
                false => std::hint::spin_loop(),
            }
        }
    }

    /// A serial phase: the first member to claim it runs `f`, the others wait until it
    /// ends. Returns `f`'s result to the member that ran it.
    pub fn solo<T>(&mut self, f: impl FnOnce(&Self) -> T) -> Option<T> {
        let p = self.next()?;
        if self.r.solo.fetch_max(p, Ordering::AcqRel) < p {
            let mut rng = self.rng ^ p;
            stress_sleep(&mut rng, 8);
            let t = f(self);
            self.r.cur.store(p + 1, Ordering::SeqCst);
            return Some(t);
        }
        self.wait_until(|| self.r.cur.load(Ordering::Acquire) > p);
        None
    }

    /// A handle that sends inputs ([`Sender::send`]), for work functions.
    pub fn sender(&self) -> Sender<'r> {
        Sender(self.r)
    }

    /// Inside [`solo`](Self::solo): the step fails (every member skips the rest).
    pub fn fail(&self) {
        self.r.failed.store(true, Ordering::Release);
    }

    /// A chunked phase of `items` items. `input`: `(buffer, width)`, the values copied
    /// first ([`Sender::send`]). `work(k, part, input)` computes item `k` into the
    /// member's own buffers, then, if the claim still stands, publishes it.
    pub fn chunks(
        &mut self,
        items: usize,
        input: Option<(usize, usize)>,
        mut work: impl FnMut(usize, Part, &[f32]),
    ) {
        let Some(p) = self.next() else {
            return;
        };
        let r = self.r;
        let (buf, width) = input.unwrap_or((0, 0));
        self.input.clear();
        self.input.extend(
            r.input[buf][..width]
                .iter()
                .map(|a| f32::from_bits(a.load(Ordering::Relaxed))),
        );
        fence(Ordering::Acquire);
        if r.cur.load(Ordering::SeqCst) == p {
            self.work_items(p, items, &mut work);
        }
    }

    fn work_items(&self, p: u64, items: usize, work: &mut impl FnMut(usize, Part, &[f32])) {
        let (r, me) = (self.r, CLAIMED + self.id as u64);
        let stress = STRESS.load(Ordering::Relaxed);
        let mut rng = self.rng ^ p;
        let input = &self.input[..];
        // The longest item this member computed in this phase: an item claimed for much
        // longer than that is late (its member lost its core), not just being computed.
        let longest = std::cell::Cell::new(Duration::ZERO);
        let claim = |k: usize, old: u64| {
            r.states[k]
                .compare_exchange(old, tag(p, me), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        };
        let mut run = |k: usize| {
            let t0 = Instant::now();
            work(k, Part::Compute, input);
            longest.set(longest.get().max(t0.elapsed()));
            stress_sleep(&mut rng, 4);
            let st = &r.states[k];
            let mine = tag(p, me);
            if st
                .compare_exchange(
                    mine,
                    tag(p, PUBLISHING),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                work(k, Part::Publish, input);
                st.store(tag(p, DONE), Ordering::Release);
            }
        };
        let start = self.id * items / self.n;
        for k in (0..items).map(|i| (start + i) % items) {
            let old = r.states[k].load(Ordering::Acquire);
            if old >> 8 < p && claim(k, old) {
                run(k);
            }
        }
        // Wait for the others' items; take over one that stays unpublished.
        for k in 0..items {
            let since = Instant::now();
            let mut looks = 0u32;
            loop {
                let v = r.states[k].load(Ordering::Acquire);
                if v >> 8 > p {
                    // A later phase's: this one has ended.
                    return;
                }
                if v >> 8 < p {
                    if r.cur.load(Ordering::Acquire) != p {
                        return;
                    }
                    if claim(k, v) {
                        run(k);
                    }
                    continue;
                }
                match v & 0xff {
                    DONE => break,
                    s if s >= CLAIMED
                        && s != me
                        && since.elapsed() > grace(longest.get(), stress) =>
                    {
                        if claim(k, v) {
                            TAKEN_OVER.fetch_add(1, Ordering::Relaxed);
                            run(k);
                        }
                    }
                    _ => {
                        if r.poisoned.load(Ordering::Relaxed) {
                            panic!("a relay team member panicked");
                        }
                        if r.cur.load(Ordering::Acquire) != p {
                            return;
                        }
                        looks = looks.wrapping_add(1);
                        match looks.is_multiple_of(64) && since.elapsed() > SPIN {
                            true => std::thread::yield_now(),
                            false => std::hint::spin_loop(),
                        }
                    }
                }
            }
        }
        // Every item is published: open the next phase (unless another member did).
        let _ = r
            .cur
            .compare_exchange(p, p + 1, Ordering::SeqCst, Ordering::Relaxed);
    }
}

/// How long an item claimed by another member may stay unpublished, given the longest
/// item this member computed in the phase: [`GRACE`] more than four times that (an item
/// still being computed is not taken over), [`GRACE`] times 10 when this member computed
/// none; no time at all under [`set_stress`].
fn grace(longest: Duration, stress: bool) -> Duration {
    match (stress, longest.is_zero()) {
        (true, _) => Duration::ZERO,
        (false, true) => 10 * GRACE,
        (false, false) => GRACE + 4 * longest,
    }
}

/// Under [`set_stress`]: sleeps 20–200 µs once in about `one_in` calls.
fn stress_sleep(rng: &mut u64, one_in: u64) {
    if !STRESS.load(Ordering::Relaxed) {
        return;
    }
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    if rng.is_multiple_of(one_in) {
        std::thread::sleep(Duration::from_micros(20 + *rng % 180));
    }
}

/// A job for the helpers: the step program, run as member `id`, and its relay (poisoned
/// if the program panics).
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    relay: &'a Relay,
}

/// A helper thread's mailbox.
struct Slot {
    /// the current job (a `Job` on the caller's stack, valid until `done == gen`)
    job: AtomicPtr<Job<'static>>,
    /// member index of this helper in the current job
    id: AtomicUsize,
    gen: AtomicU64,
    done: AtomicU64,
    panicked: AtomicBool,
}

struct Helper {
    thread: std::thread::Thread,
    slot: Arc<Slot>,
}

/// The idle helper threads. A step takes the helpers it needs (starting more when there
/// are too few) and gives them back when it ends, so steps of several sequences on
/// several threads each have their own.
static IDLE_HELPERS: Mutex<Vec<Helper>> = Mutex::new(Vec::new());

fn spawn_helper() -> Option<Helper> {
    let slot = Arc::new(Slot {
        job: AtomicPtr::new(std::ptr::null_mut()),
        id: AtomicUsize::new(0),
        gen: AtomicU64::new(0),
        done: AtomicU64::new(0),
        panicked: AtomicBool::new(false),
    });
    let mine = Arc::clone(&slot);
    let handle = std::thread::Builder::new()
        .name("tinygpt-relay".into())
        .spawn(move || helper_loop(&mine))
        .ok()?;
    Some(Helper {
        thread: handle.thread().clone(),
        slot,
    })
}

fn helper_loop(slot: &Slot) {
    let mut last = 0;
    let mut idle = Instant::now();
    loop {
        let gen = slot.gen.load(Ordering::Acquire);
        if gen != last {
            let job = slot.job.load(Ordering::Acquire);
            let id = slot.id.load(Ordering::Relaxed);
            // SAFETY: `run` keeps the job alive until it sees `done == gen` (below).
            let (f, relay) = unsafe { ((*job).f, (*job).relay) };
            if catch_unwind(AssertUnwindSafe(|| f(id))).is_err() {
                relay.poisoned.store(true, Ordering::Relaxed);
                slot.panicked.store(true, Ordering::Relaxed);
            }
            slot.done.store(gen, Ordering::Release);
            last = gen;
            idle = Instant::now();
            continue;
        }
        let quiet = idle.elapsed();
        if quiet < SPIN {
            std::hint::spin_loop();
        } else if quiet < IDLE {
            std::thread::yield_now();
        } else {
            std::thread::park_timeout(Duration::from_millis(100));
        }
    }
}

/// Runs `f(id)` for `id < n`: 0 on the calling thread, the others on helper threads, and
/// returns when all have returned. `None` (nothing ran) when a helper thread cannot be
/// started: the caller runs its step another way. `relay` is poisoned if a member panics,
/// so the others stop at their next wait; then this panics too.
pub fn run(n: usize, relay: &Relay, f: &(dyn Fn(usize) + Sync)) -> Option<()> {
    let helpers = take_helpers(n - 1)?;
    let job = Job { f, relay };
    // SAFETY (of the lifetime erased here): the helpers use the job only until they store
    // `done == gen`, and this function does not return (nor unwind: `f(0)` runs under
    // `catch_unwind`) before it has seen that for each of them.
    let ptr = &job as *const Job<'_> as *mut Job<'static>;
    let mut gens = Vec::with_capacity(helpers.len());
    for (i, h) in helpers.iter().enumerate() {
        h.slot.job.store(ptr, Ordering::Relaxed);
        h.slot.id.store(i + 1, Ordering::Relaxed);
        let gen = h.slot.gen.load(Ordering::Relaxed) + 1;
        h.slot.gen.store(gen, Ordering::Release);
        h.thread.unpark();
        gens.push(gen);
    }
    let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
    if mine.is_err() {
        relay.poisoned.store(true, Ordering::Relaxed);
    }
    // Every member must have left `f` before its borrows end.
    for (h, &gen) in helpers.iter().zip(&gens) {
        let since = Instant::now();
        while h.slot.done.load(Ordering::Acquire) != gen {
            match since.elapsed() > SPIN {
                true => std::thread::yield_now(),
                false => std::hint::spin_loop(),
            }
        }
    }
    let helper_panicked = helpers
        .iter()
        .any(|h| h.slot.panicked.swap(false, Ordering::Relaxed));
    IDLE_HELPERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(helpers);
    if let Err(e) = mine {
        std::panic::resume_unwind(e);
    }
    if helper_panicked {
        panic!("a relay team member panicked");
    }
    Some(())
}

/// `k` idle helpers, started if there are too few.
fn take_helpers(k: usize) -> Option<Vec<Helper>> {
    let mut idle = IDLE_HELPERS.lock().unwrap_or_else(|e| e.into_inner());
    let have = idle.len().min(k);
    let at = idle.len() - have;
    let mut helpers: Vec<Helper> = idle.drain(at..).collect();
    drop(idle);
    while helpers.len() < k {
        match spawn_helper() {
            Some(h) => helpers.push(h),
            None => {
                IDLE_HELPERS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(helpers);
                return None;
            }
        }
    }
    Some(helpers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_published_once_and_every_serial_phase_runs_once() {
        for members in [2, 3] {
            let relay = Relay::new(16, 4);
            let published: Vec<AtomicUsize> = (0..40 * 16).map(|_| AtomicUsize::new(0)).collect();
            let serial = AtomicUsize::new(0);
            run(members, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, members);
                for phase in 0..40 {
                    seat.chunks(16, None, |k, part, _| {
                        if part == Part::Publish {
                            published[phase * 16 + k].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    seat.solo(|_| serial.fetch_add(1, Ordering::Relaxed));
                }
            })
            .expect("helpers start");
            assert!(published.iter().all(|p| p.load(Ordering::Relaxed) == 1));
            assert_eq!(serial.load(Ordering::Relaxed), 40);
        }
    }

    #[test]
    fn a_failed_serial_phase_ends_the_step_for_every_member() {
        let relay = Relay::new(8, 4);
        let published = AtomicUsize::new(0);
        run(2, &relay, &|id| {
            let mut seat = Seat::new(&relay, id, 2);
            seat.chunks(8, None, |_, part, _| {
                if part == Part::Publish {
                    published.fetch_add(1, Ordering::Relaxed);
                }
            });
            seat.solo(|s| s.fail());
            seat.chunks(8, None, |_, _, _| panic!("work after the failure"));
            seat.solo(|_| panic!("a serial phase after the failure"));
        })
        .expect("helpers start");
        assert!(relay.failed());
        assert_eq!(published.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_member_panicking_in_a_serial_phase_stops_the_step_and_the_caller_panics() {
        let relay = Relay::new(8, 4);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            run(2, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, 2);
                if id == 0 {
                    // Member 1 claims the serial phase first, and panics inside it.
                    std::thread::sleep(Duration::from_millis(50));
                }
                seat.solo(|_| {
                    if id == 1 {
                        panic!("member 1 fails");
                    }
                });
                seat.chunks(8, None, |_, _, _| {});
            })
        }));
        assert!(outcome.is_err(), "the caller must see the member's panic");
    }
}
