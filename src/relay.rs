//! The decode team: the threads of a team share one token's step without barriers (a
//! *relay*), so a member that loses its core to another process holds the others up only
//! briefly.
//!
//! Every member runs the whole step program ([`crate::model`]'s `Model::step`); each of
//! its stages is one or more *phases*, numbered from 1 in program order, and a shared
//! counter says which phase is current. A member whose own count is behind the counter
//! skips (another member did that work), so a member that was descheduled catches up
//! without anyone waiting for it.
//!
//! * A *serial* phase ([`Seat::solo`]: norms, residual adds, the K/V append) is run by the
//!   first member to claim it; the others wait until it ends (microseconds). Serial
//!   phases run one at a time, each after the previous one has ended, so the state they
//!   share (the step's `S`, [`Relay::new`]) is handed to the member running one as `&mut`.
//! * A *chunked* phase ([`Seat::chunks`]: products, attention) is cut into items. A member
//!   claims an item by a compare-and-swap of its state word (tagged with the phase),
//!   computes it into its own buffers, and publishes it only if its claim still stands
//!   (the state then reads "publishing" until it is done, and no other member can claim
//!   it). Once nothing is left to claim, a member takes over an item another member
//!   claimed but has not published in time ([`grace`]): it recomputes it, and the late
//!   member's result is dropped. Whoever sees every item published opens the next phase,
//!   so every publish of a phase ends before the next phase starts. Items are computed by
//!   the same serial kernels whoever runs them, so the values do not depend on the team.
//! * Items publish into a [`Board`] (a buffer cut into one range per item, handed to the
//!   item's one publisher) and through the two atomic *input buffers*: a chunked phase's
//!   input vector is sent through one of them (a sequence lock on the phase counter: a
//!   late member copies it and drops the copy if the phase moved meanwhile). A serial
//!   phase sends into one; a product's items can be published straight into the other, as
//!   the next product's input. A board is read in serial phases (no item publishes then)
//!   and, one written in a single phase ([`Serial::board_once`]), by the items of later phases.
//! * A late member may still be computing an item of a phase that has ended, so whatever
//!   an item reads must stay as it is until the step ends, not only until its phase does,
//!   and no member waits for a late reader inside the step: items read only the boards
//!   of earlier phases that are never written again and what the step shares by `&`
//!   (`model/relay_step.rs`: each layer's cache and attention tables are handed to its
//!   items by a shared borrow for the rest of the step).
//!
//! The caller of [`run`] is member 0; the others are helper threads that outlive the call
//! (a rayon broadcast per token would make every token wait for its slowest member at
//! the end: docs/performance.md, "Team designs on a busy machine"). [`run`] returns only
//! when every member has left the step program, also when a member panics (the relay is
//! poisoned, every member panics at its next wait, and the caller re-panics).
//!
//! `unsafe` here, each block with its argument: the serial state's cell (one member at a
//! time, by the phase order), a [`Board`]'s ranges (one publisher per item, disjoint
//! ranges, no reader while a phase writes) and the helper threads' job (a borrow whose
//! lifetime [`run`] erases and outlives).

use std::cell::UnsafeCell;
use std::marker::PhantomData;
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

/// Item states: `phase << STATE_BITS | state`; a tag older than the phase reads as free.
const PUBLISHING: u64 = 1;
const DONE: u64 = 2;
/// Claimed by member `id`: `CLAIMED + id`.
const CLAIMED: u64 = 16;
const STATE_BITS: u32 = 16;

/// The most members a team may have: every claim's state fits below the phase.
pub const MAX_MEMBERS: usize = (1 << STATE_BITS) - CLAIMED as usize;

fn tag(phase: u64, state: u64) -> u64 {
    phase << STATE_BITS | state
}

/// A tag's phase and state.
fn untag(v: u64) -> (u64, u64) {
    (v >> STATE_BITS, v & ((1 << STATE_BITS) - 1))
}

/// What the members of a step share, whatever its serial state.
struct Core {
    /// the current phase
    cur: AtomicU64,
    /// the highest serial phase claimed
    solo: AtomicU64,
    states: Vec<AtomicU64>,
    /// two input buffers ([`Sender::send`])
    input: [Vec<AtomicU32>; 2],
    failed: AtomicBool,
    poisoned: AtomicBool,
}

/// The shared state of one step: the phase counter, the items' states, the input buffers,
/// and `S`, the state its serial phases share.
pub struct Relay<S> {
    core: Core,
    /// reached only by the member running a serial phase ([`Seat::solo`])
    serial: UnsafeCell<S>,
}

// SAFETY: everything but `serial` is atomics. `serial` is reached only in `Seat::solo`, by
// the one member that claimed the current serial phase; serial phases run one at a time,
// each after the previous one has ended (its runner opens the next phase only once it has
// returned, and a member reaches a phase only after seeing, with acquire loads, that the
// ones before it ended), and no other code reaches it. `S: Send` because that member may
// be any thread of the team.
unsafe impl<S: Send> Sync for Relay<S> {}

impl<S> Relay<S> {
    /// A step whose chunked phases have at most `items` items and whose inputs at most
    /// `width` values; `serial` is what its serial phases share.
    pub fn new(items: usize, width: usize, serial: S) -> Relay<S> {
        Relay {
            core: Core {
                cur: AtomicU64::new(1),
                solo: AtomicU64::new(0),
                states: (0..items).map(|_| AtomicU64::new(0)).collect(),
                input: [0, 1].map(|_| (0..width).map(|_| AtomicU32::new(0)).collect()),
                failed: AtomicBool::new(false),
                poisoned: AtomicBool::new(false),
            },
            serial: UnsafeCell::new(serial),
        }
    }

    /// Whether a serial phase failed ([`Serial::fail`]).
    pub fn failed(&self) -> bool {
        self.core.failed.load(Ordering::Acquire)
    }

    /// The serial state, after the step.
    pub fn into_serial(self) -> S {
        self.serial.into_inner()
    }

    /// A board of this step over `buf`, cut at `cuts` ([`Board`]).
    pub fn board<'a>(&self, buf: &'a mut [f32], cuts: &'a [usize]) -> Option<Board<'a>> {
        Board::new(&self.core, buf, cuts, false)
    }
}

/// Which part of an item [`Seat::chunks`] asks the work function for.
pub enum Part<'x> {
    /// Compute the item into the member's own buffers, from the phase's input as copied
    /// ([`Phase::input`]) and the board it reads ([`Phase::reads`]; empty without one).
    Compute { input: &'x [f32], read: &'x [f32] },
    /// The claim still stands: publish the result, into the item's range of the phase's
    /// board ([`Phase::writes`]; empty without one) and the input buffers ([`Sender`]).
    Publish(&'x mut [f32]),
}

/// A chunked phase ([`Seat::chunks`]).
#[derive(Clone, Copy, Default)]
pub struct Phase<'b, 'a> {
    /// how many items
    pub items: usize,
    /// `(buffer, width)`: the input values the items copy first ([`Sender::send`])
    pub input: Option<(usize, usize)>,
    /// a board an earlier phase wrote, once ([`Serial::board_once`]), that the items read
    pub reads: Option<&'b Board<'a>>,
    /// the board the items publish into, item `k` its range `k`
    pub writes: Option<&'b Board<'a>>,
}

/// Writes chunked phases' inputs into a [`Relay`]'s input buffers.
#[derive(Clone, Copy)]
pub struct Sender<'r>(&'r Core);

impl Sender<'_> {
    /// Writes `v` at `at` of input buffer `buf` (0 or 1), for a later chunked phase: in a
    /// serial phase, or publishing an item ([`Part::Publish`]) into the buffer the next
    /// product reads, which must not be the one the publishing phase reads.
    pub fn send(self, buf: usize, at: usize, v: &[f32]) {
        // Ordered after this phase's start, which a late reader's check will see.
        fence(Ordering::Release);
        for (a, x) in self.0.input[buf][at..].iter().zip(v) {
            a.store(x.to_bits(), Ordering::Relaxed);
        }
    }
}

/// What the member running a serial phase may do besides changing the serial state
/// ([`Seat::solo`]): send inputs, fail the step, read boards and make boards for later
/// phases. It lives only as long as the phase.
pub struct Serial<'t> {
    core: &'t Core,
}

impl<'t> Serial<'t> {
    /// Writes `v` at `at` of input buffer `buf` ([`Sender::send`]).
    pub fn send(&self, buf: usize, at: usize, v: &[f32]) {
        Sender(self.core).send(buf, at, v);
    }

    /// The step fails: every member skips the rest.
    pub fn fail(&self) {
        self.core.failed.store(true, Ordering::Release);
    }

    /// A board of this step over `buf`, cut at `cuts`, that items publish into in one
    /// phase only and items of later phases may then read ([`Serial::board_once`]).
    pub fn board_once<'a>(&self, buf: &'a mut [f32], cuts: &'a [usize]) -> Option<Board<'a>> {
        Board::new(self.core, buf, cuts, true)
    }
}

/// A buffer the items of a step's chunked phases publish into: item `k` of a phase that
/// writes it ([`Phase::writes`]) gets `cuts[k]..cuts[k + 1]` ([`Part::Publish`]). It is read
/// in serial phases ([`Board::read`]), when no item publishes, and, made to be written in
/// one phase only ([`Serial::board_once`]), by the items of later phases ([`Phase::reads`]).
/// The step's owner reads the buffer again once the board is dropped.
pub struct Board<'a> {
    ptr: *mut f32,
    len: usize,
    cuts: &'a [usize],
    /// written in one phase only; items of later phases may read it
    once: bool,
    /// the phase that wrote it (`once` boards; 0: none yet)
    written: AtomicU64,
    /// the relay whose phases write it (compared, never dereferenced)
    owner: *const Core,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a board is the exclusive borrow of its buffer, shared by the members of its
// relay's step (the owner) and reached only through `Board::read` (in a serial phase of
// that relay: no item publishes then), `Board::read_at` (a `once` board whose one writing
// phase has ended: nothing writes it again) and `Board::item_mut` (item `k`'s range, to the
// one member whose claim of `k` stands, while the phase is current; the ranges of a
// phase's items are disjoint, `cuts` being checked non-decreasing). `f32` is `Send + Sync`.
unsafe impl Send for Board<'_> {}
// SAFETY: as above.
unsafe impl Sync for Board<'_> {}

impl<'a> Board<'a> {
    /// `None` unless `cuts` is non-decreasing and ends within `buf`.
    fn new(owner: &Core, buf: &'a mut [f32], cuts: &'a [usize], once: bool) -> Option<Self> {
        let fits = cuts.windows(2).all(|w| w[0] <= w[1]) && cuts.last() <= Some(&buf.len());
        fits.then(|| Board {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            cuts,
            once,
            written: AtomicU64::new(0),
            owner,
            _borrow: PhantomData,
        })
    }

    /// How many items it is cut for.
    pub fn items(&self) -> usize {
        self.cuts.len().saturating_sub(1)
    }

    /// The whole buffer, in a serial phase of its relay.
    pub fn read<'t>(&'t self, serial: &'t Serial<'_>) -> &'t [f32] {
        assert!(
            std::ptr::eq(self.owner, serial.core),
            "a board read in another relay's serial phase"
        );
        // SAFETY: in a serial phase no item publishes (every publish of a phase ends before
        // the next phase starts, and the serial phase is current until it returns), and
        // the borrow cannot outlive `serial`, which lives only as long as the phase.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The whole buffer, for an item of phase `p` of relay `owner`.
    fn read_at(&self, owner: &Core, p: u64) -> &[f32] {
        let w = self.written.load(Ordering::Acquire);
        assert!(
            std::ptr::eq(self.owner, owner) && self.once && w != 0 && w < p,
            "items read only a `once` board of their relay that an earlier phase wrote"
        );
        // SAFETY: written in phase `w` only (`item_mut` refuses any other phase), which has
        // ended for a member at phase `p > w`, its publishes ordered before by the acquire
        // loads that brought the member here.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Item `k`'s range, for its publisher in phase `p` of relay `owner`.
    #[allow(clippy::mut_from_ref)]
    fn item_mut(&self, owner: &Core, k: usize, p: u64) -> &mut [f32] {
        assert!(std::ptr::eq(self.owner, owner), "a board of another relay");
        if self.once {
            if let Err(w) = self
                .written
                .compare_exchange(0, p, Ordering::AcqRel, Ordering::Acquire)
            {
                assert_eq!(w, p, "a `once` board written in two phases");
            }
        }
        let (a, b) = (self.cuts[k], self.cuts[k + 1]);
        // SAFETY: within the buffer (`cuts` checked at `new`), disjoint from every other
        // item's range, and handed only to the member whose claim of item `k` stands in
        // the current phase `p`, which alone publishes `k` (module notes); nobody reads the
        // board while `p` is current (`read`, `read_at`), and the reference does not
        // outlive the publish.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(a), b - a) }
    }
}

/// One member's place in a [`Relay`]: its index, the team's size and its phase count.
pub struct Seat<'r, S> {
    r: &'r Relay<S>,
    pub id: usize,
    pub n: usize,
    /// the phase this member's program is at
    p: u64,
    /// this phase's input, as copied
    input: Vec<f32>,
    /// [`set_stress`]'s random state
    rng: u64,
}

impl<'r, S> Seat<'r, S> {
    /// Member `id` of a team of `n` (at most [`MAX_MEMBERS`]; each member its own `id`).
    pub fn new(r: &'r Relay<S>, id: usize, n: usize) -> Seat<'r, S> {
        assert!(id < n && n <= MAX_MEMBERS, "member {id} of a team of {n}");
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
        let core = &self.r.core;
        if core.failed.load(Ordering::Acquire) || core.cur.load(Ordering::Acquire) > p {
            return None;
        }
        Some(p)
    }

    /// Spins, then yields, until `done()`; panics if the relay is poisoned.
    fn wait_until(&self, mut done: impl FnMut() -> bool) {
        let since = Instant::now();
        let mut looks = 0u32;
        while !done() {
            if self.r.core.poisoned.load(Ordering::Relaxed) {
                panic!("a relay team member panicked");
            }
            looks = looks.wrapping_add(1);
            match looks.is_multiple_of(64) && since.elapsed() > SPIN {
                true => std::thread::yield_now(),
                false => std::hint::spin_loop(),
            }
        }
    }

    /// A serial phase: the first member to claim it runs `f` on the serial state, the
    /// others wait until it ends. Returns `f`'s result to the member that ran it.
    pub fn solo<T>(&mut self, f: impl FnOnce(&mut S, &Serial<'_>) -> T) -> Option<T> {
        let p = self.next()?;
        let core = &self.r.core;
        if core.solo.fetch_max(p, Ordering::AcqRel) < p {
            let mut rng = self.rng ^ p;
            stress_sleep(&mut rng, 8);
            // SAFETY: this member alone claimed serial phase `p` (`fetch_max`), which is
            // current (a member reaches phase `p` only once `cur >= p`, and `next` saw
            // `cur <= p`), so every earlier serial phase has ended and no later one can
            // start before `cur` moves on, below; nothing else reaches `serial`.
            let state = unsafe { &mut *self.r.serial.get() };
            let t = f(state, &Serial { core });
            core.cur.store(p + 1, Ordering::SeqCst);
            return Some(t);
        }
        self.wait_until(|| core.cur.load(Ordering::Acquire) > p);
        None
    }

    /// A handle that sends inputs ([`Sender::send`]), for work functions.
    pub fn sender(&self) -> Sender<'r> {
        Sender(&self.r.core)
    }

    /// A chunked phase. `work(k, part)` computes item `k` into the member's own buffers
    /// ([`Part::Compute`]), then, if the claim still stands, publishes it
    /// ([`Part::Publish`]).
    pub fn chunks(&mut self, phase: Phase<'_, '_>, mut work: impl FnMut(usize, Part<'_>)) {
        let Some(p) = self.next() else {
            return;
        };
        let core = &self.r.core;
        let (buf, width) = phase.input.unwrap_or((0, 0));
        self.input.clear();
        self.input.extend(
            core.input[buf][..width]
                .iter()
                .map(|a| f32::from_bits(a.load(Ordering::Relaxed))),
        );
        fence(Ordering::Acquire);
        if core.cur.load(Ordering::SeqCst) != p {
            return;
        }
        assert!(
            phase.items <= core.states.len()
                && phase.writes.is_none_or(|b| b.items() == phase.items),
            "a phase of more items than the relay has, or than its board is cut for"
        );
        let read = phase.reads.map_or(&[][..], |b| b.read_at(core, p));
        self.work_items(p, phase, read, &mut work);
    }

    fn work_items(
        &self,
        p: u64,
        phase: Phase<'_, '_>,
        read: &[f32],
        work: &mut impl FnMut(usize, Part<'_>),
    ) {
        let (core, me, items) = (&self.r.core, CLAIMED + self.id as u64, phase.items);
        let stress = STRESS.load(Ordering::Relaxed);
        let mut rng = self.rng ^ p;
        let input = &self.input[..];
        // The longest item this member computed in this phase: an item claimed for much
        // longer than that is late (its member lost its core), not just being computed.
        let longest = std::cell::Cell::new(Duration::ZERO);
        let claim = |k: usize, old: u64| {
            core.states[k]
                .compare_exchange(old, tag(p, me), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        };
        let mut run = |k: usize| {
            let t0 = Instant::now();
            work(k, Part::Compute { input, read });
            longest.set(longest.get().max(t0.elapsed()));
            stress_sleep(&mut rng, 4);
            let st = &core.states[k];
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
                let out = match phase.writes {
                    Some(b) => b.item_mut(core, k, p),
                    None => &mut [],
                };
                work(k, Part::Publish(out));
                st.store(tag(p, DONE), Ordering::Release);
            }
        };
        let start = self.id * items / self.n;
        for k in (0..items).map(|i| (start + i) % items) {
            let old = core.states[k].load(Ordering::Acquire);
            if untag(old).0 < p && claim(k, old) {
                run(k);
            }
        }
        // Wait for the others' items; take over one that stays unpublished.
        for k in 0..items {
            let since = Instant::now();
            let mut looks = 0u32;
            loop {
                let v = core.states[k].load(Ordering::Acquire);
                if untag(v).0 > p {
                    // A later phase's: this one has ended.
                    return;
                }
                if untag(v).0 < p {
                    if core.cur.load(Ordering::Acquire) != p {
                        return;
                    }
                    if claim(k, v) {
                        run(k);
                    }
                    continue;
                }
                match untag(v).1 {
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
                        if core.poisoned.load(Ordering::Relaxed) {
                            panic!("a relay team member panicked");
                        }
                        if core.cur.load(Ordering::Acquire) != p {
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
        let _ = core
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

/// A job for the helpers: the step program, run as member `id`, and its relay's poison
/// flag (set if the program panics).
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    poisoned: &'a AtomicBool,
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
            let (f, poisoned) = unsafe { ((*job).f, (*job).poisoned) };
            if catch_unwind(AssertUnwindSafe(|| f(id))).is_err() {
                poisoned.store(true, Ordering::Relaxed);
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
pub fn run<S: Send>(n: usize, relay: &Relay<S>, f: &(dyn Fn(usize) + Sync)) -> Option<()> {
    let helpers = take_helpers(n - 1)?;
    let poisoned = &relay.core.poisoned;
    let job = Job { f, poisoned };
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
        poisoned.store(true, Ordering::Relaxed);
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
    use std::sync::OnceLock;

    fn items(items: usize) -> Phase<'static, 'static> {
        Phase {
            items,
            ..Phase::default()
        }
    }

    #[test]
    fn every_item_is_published_once_and_every_serial_phase_runs_once() {
        for members in [2, 3] {
            let relay = Relay::new(16, 4, 0usize);
            let published: Vec<AtomicUsize> = (0..40 * 16).map(|_| AtomicUsize::new(0)).collect();
            run(members, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, members);
                for phase in 0..40 {
                    seat.chunks(items(16), |k, part| {
                        if let Part::Publish(_) = part {
                            published[phase * 16 + k].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    // A plain `+= 1` on the serial state: serial phases run one at a time.
                    seat.solo(|count, _| *count += 1);
                }
            })
            .expect("helpers start");
            assert!(published.iter().all(|p| p.load(Ordering::Relaxed) == 1));
            assert_eq!(relay.into_serial(), 40);
        }
    }

    #[test]
    fn a_failed_serial_phase_ends_the_step_for_every_member() {
        let relay = Relay::new(8, 4, ());
        let published = AtomicUsize::new(0);
        run(2, &relay, &|id| {
            let mut seat = Seat::new(&relay, id, 2);
            seat.chunks(items(8), |_, part| {
                if let Part::Publish(_) = part {
                    published.fetch_add(1, Ordering::Relaxed);
                }
            });
            seat.solo(|_, s| s.fail());
            seat.chunks(items(8), |_, _| panic!("work after the failure"));
            seat.solo(|_, _| panic!("a serial phase after the failure"));
        })
        .expect("helpers start");
        assert!(relay.failed());
        assert_eq!(published.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_member_panicking_in_a_serial_phase_stops_the_step_and_the_caller_panics() {
        let relay = Relay::new(8, 4, ());
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            run(2, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, 2);
                if id == 0 {
                    // Member 1 claims the serial phase first, and panics inside it.
                    std::thread::sleep(Duration::from_millis(50));
                }
                seat.solo(|_, _| {
                    if id == 1 {
                        panic!("member 1 fails");
                    }
                });
                seat.chunks(items(8), |_, _| {});
            })
        }));
        assert!(outcome.is_err(), "the caller must see the member's panic");
    }

    /// A serial phase makes a `once` board; one phase's items publish into their ranges of
    /// it, the next phase's items read it whole and publish a sum each into a board of the
    /// step, which a serial phase reads: every value where it belongs, on 2 and 3 members.
    #[test]
    fn items_publish_their_ranges_and_later_phases_read_them() {
        for members in [2, 3] {
            let (mut values, mut sums) = (vec![0.0f32; 40], vec![0.0f32; 10]);
            let value_cuts: Vec<usize> = (0..=10).map(|k| 4 * k).collect();
            let sum_cuts: Vec<usize> = (0..=10).collect();
            let relay = Relay::new(16, 4, Some(&mut values[..]));
            let sums = relay.board(&mut sums, &sum_cuts).expect("cuts");
            let made = OnceLock::new();
            let seen = Mutex::new(Vec::new());
            run(members, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, members);
                seat.solo(|values, s| {
                    let values = values.take().expect("one serial phase makes it");
                    let board = s.board_once(values, &value_cuts).expect("cuts");
                    assert!(made.set(board).is_ok());
                });
                let values = made.get().expect("made before the phases that use it");
                let write = Phase {
                    writes: Some(values),
                    ..items(10)
                };
                seat.chunks(write, |k, part| {
                    if let Part::Publish(out) = part {
                        for (i, x) in out.iter_mut().enumerate() {
                            *x = (4 * k + i) as f32;
                        }
                    }
                });
                let mut sum = 0.0;
                let read = Phase {
                    reads: Some(values),
                    writes: Some(&sums),
                    ..items(10)
                };
                seat.chunks(read, |k, part| match part {
                    Part::Compute { read, .. } => sum = read[4 * k..4 * k + 4].iter().sum(),
                    Part::Publish(out) => out[0] = sum,
                });
                seat.solo(|_, s| seen.lock().expect("lock").push(sums.read(s).to_vec()));
            })
            .expect("helpers start");
            let want: Vec<f32> = (0..10).map(|k| (16 * k + 6) as f32).collect();
            assert_eq!(seen.into_inner().expect("lock"), [want]);
        }
    }

    /// A claim's state must fit below the phase in an item's tag: no team of more than
    /// `MAX_MEMBERS`, no member outside its team.
    #[test]
    fn seats_fit_the_tags() {
        let relay = Relay::new(1, 1, ());
        let _ = Seat::new(&relay, MAX_MEMBERS - 1, MAX_MEMBERS);
        assert_eq!(untag(tag(7, CLAIMED + MAX_MEMBERS as u64 - 1)).0, 7);
        for (id, n) in [(0, MAX_MEMBERS + 1), (2, 2)] {
            let made = catch_unwind(AssertUnwindSafe(|| Seat::new(&relay, id, n).id));
            assert!(made.is_err(), "member {id} of {n}");
        }
    }

    /// What a board refuses: cuts that go back or past the buffer; items reading a board
    /// that phases may write again, or that no earlier phase wrote; a `once` board written
    /// in two phases; a board of another relay.
    #[test]
    fn boards_refuse_what_could_race() {
        let mut buf = [0.0f32; 8];
        let relay = Relay::new(4, 4, ());
        assert!(relay.board(&mut buf, &[0, 5, 4]).is_none());
        assert!(relay.board(&mut buf, &[0, 4, 9]).is_none());
        let cuts = [0, 4, 8];
        type Misuse = fn(&mut Seat<'_, Option<&mut [f32]>>, &Board<'_>);
        let misuses: [(&str, bool, Misuse); 3] = [
            (
                "items read a board written in many phases",
                false,
                |seat, b| {
                    seat.chunks(
                        Phase {
                            writes: Some(b),
                            ..items(2)
                        },
                        |_, _| {},
                    );
                    seat.chunks(
                        Phase {
                            reads: Some(b),
                            ..items(2)
                        },
                        |_, _| {},
                    );
                },
            ),
            ("items read a board nothing wrote", true, |seat, b| {
                seat.chunks(
                    Phase {
                        reads: Some(b),
                        ..items(2)
                    },
                    |_, _| {},
                );
            }),
            ("a once board written twice", true, |seat, b| {
                seat.chunks(
                    Phase {
                        writes: Some(b),
                        ..items(2)
                    },
                    |_, _| {},
                );
                seat.chunks(
                    Phase {
                        writes: Some(b),
                        ..items(2)
                    },
                    |_, _| {},
                );
            }),
        ];
        for (what, once, misuse) in misuses {
            let mut buf = [0.0f32; 8];
            let relay = Relay::new(4, 4, Some(&mut buf[..]));
            let board = OnceLock::new();
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                run(2, &relay, &|id| {
                    let mut seat = Seat::new(&relay, id, 2);
                    seat.solo(|buf, s| {
                        let buf = buf.take().expect("one serial phase");
                        let b = match once {
                            true => s.board_once(buf, &cuts),
                            false => Board::new(s.core, buf, &cuts, false),
                        };
                        assert!(board.set(b.expect("cuts")).is_ok());
                    });
                    let b = board.get().expect("made");
                    misuse(&mut seat, b);
                })
            }));
            assert!(outcome.is_err(), "{what}: not refused");
        }
        let mut other = [0.0f32; 8];
        let theirs = Relay::new(4, 4, ()).board(&mut other, &cuts).expect("cuts");
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            run(2, &relay, &|id| {
                let mut seat = Seat::new(&relay, id, 2);
                seat.chunks(
                    Phase {
                        writes: Some(&theirs),
                        ..items(2)
                    },
                    |_, _| {},
                );
            })
        }));
        assert!(outcome.is_err(), "a board of another relay: not refused");
    }
}
