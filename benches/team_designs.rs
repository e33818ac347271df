//! Decode-team designs on a busy machine (issue 26), on a synthetic decode step: which
//! way of sharing one token's products between two threads survives another process
//! taking a core. Not the engine's code: a model of its step, small enough to read.
//!
//! The step: 8 layers of 4 dependent f32 matrix-vector products (960×576, 576×960,
//! 1536×576, 576×1536: SmolLM2-135M's q/k/v, o, gate/up and down widths), each followed by
//! a serial RMS normalisation of its output (the residual/norm work a step does between
//! products). Rows are cut into chunks of 32. Every design must give the serial result bit
//! for bit (checked every token).
//!
//! * `solo`: one thread.
//! * `barrier`: the engine's team (`src/team.rs`): one rayon broadcast per token, both
//!   threads claim chunks, and meet at a barrier (spin 50 µs, then sleep) after each
//!   product and after each serial step. A member that loses its core stalls the other.
//! * `relay`: no barrier. Each product's chunks carry a state word tagged with the
//!   phase; a thread claims free chunks, computes each into its own buffer and publishes
//!   it by a compare-and-swap, and once nothing is free it takes over (recomputes) a chunk
//!   the other claimed but has not published within 20 µs. Whoever sees the last chunk
//!   published runs the serial step and opens the next phase, whose input goes out under
//!   a sequence lock. A thread that lost its core finds the phase gone when it is back,
//!   drops its work and joins the current one. The two threads run every token without
//!   meeting (persistent threads, as a helper thread outside the rayon pool would).
//! * `relay-drain`: the same relay on persistent threads, but driven token by token as
//!   an engine's step would be: the calling thread opens a token (the helper may not start
//!   it earlier: the next token is not sampled yet), works on it, and returns only once
//!   the helper is not inside a phase (a helper still computing a chunk that was taken
//!   over holds references into the step's buffers and cache).
//! * `relay-drain-1/4`: as `relay-drain`, but only the second product of each layer (a
//!   quarter of the work, as attention, whose reads of the cache outlive nothing else)
//!   makes the step wait; the others read only what outlives the step.
//! * `relay-join`: the same relay, but each token is one rayon broadcast, as the engine's
//!   team is: the token ends when both threads have returned.
//!
//! `cargo bench --bench team_designs -- [--tokens N] [--rounds R] [--background-load]`:
//! R rounds (default 3) of every design in turn, N tokens each (default 300); medians,
//! spread and the ratio to `solo`. `--background-load` runs one CPU-bound process
//! (`sh -c 'while :; do :; done'`) beside every round.

use std::process::{Child, Command};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rows per chunk.
const CHUNK: usize = 32;
/// How long a chunk another thread claimed may stay unpublished before it is taken over.
const GRACE: Duration = Duration::from_micros(20);
/// How long a barrier member spins before it sleeps (as `src/team.rs`).
const SPIN: Duration = Duration::from_micros(50);
const LAYERS: usize = 8;
const WIDEST: usize = 1536;

struct Mat {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
}

impl Mat {
    fn new(rows: usize, cols: usize, seed: u32) -> Mat {
        let mut s = seed.wrapping_mul(2_654_435_761) | 1;
        let w = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                s as f32 / u32::MAX as f32 - 0.5
            })
            .collect();
        Mat { rows, cols, w }
    }

    fn chunks(&self) -> usize {
        self.rows.div_ceil(CHUNK)
    }

    fn chunk_rows(&self, k: usize) -> std::ops::Range<usize> {
        k * CHUNK..((k + 1) * CHUNK).min(self.rows)
    }

    /// Rows `r0..r0 + out.len()` of `self · x`, each in one fixed order (8 lanes).
    fn rows_into(&self, x: &[f32], r0: usize, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            let row = &self.w[(r0 + i) * self.cols..(r0 + i + 1) * self.cols];
            let mut acc = [0f32; 8];
            for (w, x) in row.chunks_exact(8).zip(x.chunks_exact(8)) {
                for j in 0..8 {
                    acc[j] += w[j] * x[j];
                }
            }
            *o = acc.iter().sum::<f32>() * 0.05;
        }
    }
}

/// The products in step order.
fn model() -> Vec<Mat> {
    let dims = [(960, 576), (576, 960), (1536, 576), (576, 1536)];
    (0..LAYERS * 4)
        .map(|p| Mat::new(dims[p % 4].0, dims[p % 4].1, p as u32 + 1))
        .collect()
}

/// The serial step between two products.
fn serial(v: &mut [f32]) {
    let ms = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
    let r = 1.0 / (ms + 1e-5).sqrt();
    v.iter_mut().for_each(|x| *x *= r);
}

fn solo_token(m: &[Mat], x0: &[f32]) -> Vec<f32> {
    let mut x = x0.to_vec();
    for w in m {
        let mut o = vec![0.0; w.rows];
        w.rows_into(&x, 0, &mut o);
        serial(&mut o);
        x = o;
    }
    x
}

/// A sense-reversing barrier for two threads that spins, then sleeps in 20 µs naps.
struct Barrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl Barrier {
    fn wait(&self, n: usize) {
        let gen = self.generation.load(Ordering::SeqCst);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.store(gen + 1, Ordering::SeqCst);
            return;
        }
        let start = Instant::now();
        while self.generation.load(Ordering::SeqCst) == gen {
            match start.elapsed() > SPIN {
                true => std::thread::sleep(Duration::from_micros(20)),
                false => std::hint::spin_loop(),
            }
        }
    }
}

/// Output rows written by whichever member computed them (disjoint between two waits).
struct Out(*mut f32);
// SAFETY: the designs below write disjoint rows between synchronisations.
unsafe impl Sync for Out {}

fn barrier_token(m: &[Mat], x0: &[f32], out: &Out, bar: &Barrier, next: &AtomicUsize) -> Vec<f32> {
    let results = rayon::broadcast(|ctx| {
        let n = ctx.num_threads();
        let mut x = x0.to_vec();
        for w in m {
            let items = w.chunks();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= items {
                    break;
                }
                let r = w.chunk_rows(k);
                // SAFETY: chunk `k` is claimed once; read after the barrier.
                let o = unsafe { std::slice::from_raw_parts_mut(out.0.add(r.start), r.len()) };
                w.rows_into(&x, r.start, o);
            }
            bar.wait(n);
            // SAFETY: complete after the barrier; next written after the one below.
            let mut v = unsafe { std::slice::from_raw_parts(out.0, w.rows) }.to_vec();
            serial(&mut v);
            x = v;
            if ctx.index() == 0 {
                next.store(0, Ordering::Relaxed);
            }
            bar.wait(n);
        }
        x
    });
    results.into_iter().next().unwrap_or_default()
}

/// Chunk states: `phase << 8 | state`; a tag older than the phase reads as free.
const PUBLISHING: u64 = 1;
const DONE: u64 = 2;
/// Claimed by member `id`: `CLAIMED + id`.
const CLAIMED: u64 = 16;

fn tag(phase: u64, state: u64) -> u64 {
    phase << 8 | state
}

/// The relay's shared state. `phase` counts products from 0 across tokens, times two:
/// odd while the serial step of the finished product writes the next input.
struct Relay {
    phase: AtomicU64,
    input: Vec<AtomicU32>,
    states: Vec<AtomicU64>,
    advance: AtomicU64,
    out: Out,
    taken_over: AtomicUsize,
    /// products the driver has let start (`relay-drain`; unlimited otherwise)
    open: AtomicU64,
    /// the helper is inside a phase (`relay-drain`: holds references into the step)
    inside: AtomicBool,
    /// which products of each layer (bit `index % 4`) hold references into the step
    /// while they run (`relay-drain`: the step waits for them to finish)
    held: AtomicU64,
    /// the last finished token's output
    result: Mutex<Vec<f32>>,
}

impl Relay {
    fn new(out: *mut f32, x0: &[f32]) -> Relay {
        let r = Relay {
            phase: AtomicU64::new(0),
            input: (0..WIDEST).map(|_| AtomicU32::new(0)).collect(),
            states: (0..WIDEST / CHUNK).map(|_| AtomicU64::new(0)).collect(),
            advance: AtomicU64::new(0),
            out: Out(out),
            taken_over: AtomicUsize::new(0),
            open: AtomicU64::new(u64::MAX),
            inside: AtomicBool::new(false),
            held: AtomicU64::new(0),
            result: Mutex::new(Vec::new()),
        };
        for (a, v) in r.input.iter().zip(x0) {
            a.store(v.to_bits(), Ordering::Relaxed);
        }
        r
    }

    /// Computes chunk `k` of `w` into `mine` and publishes it if the chunk is still
    /// claimed by `me` in phase `p`.
    fn run(&self, w: &Mat, k: usize, x: &[f32], mine: &mut [f32], p: u64, me: u64) {
        let r = w.chunk_rows(k);
        w.rows_into(x, r.start, &mut mine[..r.len()]);
        let st = &self.states[k];
        let claimed = tag(p, CLAIMED + me);
        if st
            .compare_exchange(
                claimed,
                tag(p, PUBLISHING),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            // SAFETY: the compare-and-swap made this member the chunk's only writer in
            // phase `p`; the rows are read after `DONE`.
            unsafe {
                std::ptr::copy_nonoverlapping(mine.as_ptr(), self.out.0.add(r.start), r.len())
            };
            st.store(tag(p, DONE), Ordering::Release);
        }
    }

    /// Member `me` runs products until `end` of them are done (the output of each token
    /// goes to `result`), none past `open`.
    fn member(&self, m: &[Mat], x0: &[f32], me: u64, end: u64) {
        let mut x = vec![0f32; WIDEST];
        let mut mine = vec![0f32; CHUNK];
        let mut idle = Instant::now();
        loop {
            if me != 0 {
                self.inside.store(false, Ordering::Release);
            }
            let seq = self.phase.load(Ordering::Acquire);
            if seq & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            // Products done so far; chunk tags count phases from 1 (0 is "never claimed").
            let done = seq / 2;
            if done >= end {
                return;
            }
            if done >= self.open.load(Ordering::Acquire) {
                // The driver has not started the next token yet.
                match idle.elapsed() > SPIN {
                    true => std::thread::yield_now(),
                    false => std::hint::spin_loop(),
                }
                continue;
            }
            idle = Instant::now();
            if me != 0 && self.held.load(Ordering::Relaxed) >> (done % 4) & 1 == 1 {
                self.inside.store(true, Ordering::SeqCst);
            }
            let p = done + 1;
            let w = &m[done as usize % m.len()];
            // Sequence lock: copy, then check that the phase did not move meanwhile.
            for (v, a) in x.iter_mut().zip(&self.input[..w.cols]) {
                *v = f32::from_bits(a.load(Ordering::Relaxed));
            }
            fence(Ordering::Acquire);
            if self.phase.load(Ordering::SeqCst) != seq {
                continue;
            }
            let items = w.chunks();
            let claim = |k: usize, old: u64| {
                self.states[k]
                    .compare_exchange(
                        old,
                        tag(p, CLAIMED + me),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            };
            let start = me as usize * items / 2;
            for k in (0..items).map(|i| (start + i) % items) {
                let old = self.states[k].load(Ordering::Acquire);
                if old >> 8 < p && claim(k, old) {
                    self.run(w, k, &x[..w.cols], &mut mine, p, me);
                }
            }
            // Wait for the other's chunks; take over one that stays unpublished.
            let mut gone = false;
            'chunks: for k in 0..items {
                let since = Instant::now();
                loop {
                    let v = self.states[k].load(Ordering::Acquire);
                    if v >> 8 != p {
                        gone = v >> 8 > p || self.phase.load(Ordering::Acquire) != seq;
                        if gone {
                            break 'chunks;
                        }
                        if claim(k, v) {
                            self.run(w, k, &x[..w.cols], &mut mine, p, me);
                        }
                        continue;
                    }
                    match v & 0xff {
                        DONE => break,
                        s if s >= CLAIMED && s != CLAIMED + me && since.elapsed() > GRACE => {
                            if claim(k, v) {
                                self.taken_over.fetch_add(1, Ordering::Relaxed);
                                self.run(w, k, &x[..w.cols], &mut mine, p, me);
                            }
                        }
                        _ => std::hint::spin_loop(),
                    }
                }
            }
            if gone {
                continue;
            }
            // Every chunk is published: one member runs the serial step.
            if self
                .advance
                .compare_exchange(seq, seq + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                let since = Instant::now();
                while self.phase.load(Ordering::Acquire) == seq {
                    match since.elapsed() > SPIN {
                        true => std::thread::yield_now(),
                        false => std::hint::spin_loop(),
                    }
                }
                continue;
            }
            // SAFETY: every chunk of phase `p` is `DONE` (acquired above); nobody writes
            // `out` before the phase opened below.
            let mut v = unsafe { std::slice::from_raw_parts(self.out.0, w.rows) }.to_vec();
            serial(&mut v);
            let token_ends = (p as usize).is_multiple_of(m.len());
            self.phase.store(seq + 1, Ordering::Relaxed);
            fence(Ordering::Release);
            let next_input = if token_ends { x0 } else { &v[..] };
            for (a, x) in self.input.iter().zip(next_input) {
                a.store(x.to_bits(), Ordering::Relaxed);
            }
            if token_ends {
                *self.result.lock().expect("result") = v;
            }
            self.advance.store(seq + 2, Ordering::Relaxed);
            self.phase.store(seq + 2, Ordering::Release);
        }
    }
}

/// Tokens per second of `design`, after checking every token against `want`.
fn run_design(design: &str, m: &[Mat], x0: &[f32], want: &[f32], tokens: usize) -> (f64, usize) {
    let mut out = vec![0f32; WIDEST];
    let check = |got: &[f32]| assert_eq!(got, want, "{design}: not the serial result");
    let t0 = Instant::now();
    let mut taken_over = 0;
    match design {
        "solo" => (0..tokens).for_each(|_| check(&solo_token(m, x0))),
        "barrier" => {
            let bar = Barrier {
                arrived: AtomicUsize::new(0),
                generation: AtomicUsize::new(0),
            };
            let next = AtomicUsize::new(0);
            let o = Out(out.as_mut_ptr());
            (0..tokens).for_each(|_| check(&barrier_token(m, x0, &o, &bar, &next)));
        }
        "relay" => {
            let relay = Relay::new(out.as_mut_ptr(), x0);
            let end = (tokens * m.len()) as u64;
            std::thread::scope(|s| {
                for me in 0..2 {
                    let relay = &relay;
                    s.spawn(move || relay.member(m, x0, me, end));
                }
            });
            check(&relay.result.lock().expect("result"));
            taken_over = relay.taken_over.load(Ordering::Relaxed);
        }
        "relay-drain" | "relay-drain-1/4" => {
            let relay = Relay::new(out.as_mut_ptr(), x0);
            relay.open.store(0, Ordering::Relaxed);
            let held = if design == "relay-drain" {
                0b1111
            } else {
                0b0010
            };
            relay.held.store(held, Ordering::Relaxed);
            let end = (tokens * m.len()) as u64;
            std::thread::scope(|s| {
                let r = &relay;
                s.spawn(move || r.member(m, x0, 1, end));
                for t in 1..=tokens {
                    let token_end = (t * m.len()) as u64;
                    relay.open.store(token_end, Ordering::Release);
                    relay.member(m, x0, 0, token_end);
                    // The step may return only once the helper holds nothing of it.
                    let since = Instant::now();
                    while relay.inside.load(Ordering::SeqCst) {
                        match since.elapsed() > SPIN {
                            true => std::thread::yield_now(),
                            false => std::hint::spin_loop(),
                        }
                    }
                    check(&relay.result.lock().expect("result"));
                }
            });
            taken_over = relay.taken_over.load(Ordering::Relaxed);
        }
        "relay-join" => {
            for _ in 0..tokens {
                let relay = Relay::new(out.as_mut_ptr(), x0);
                let end = m.len() as u64;
                rayon::broadcast(|ctx| relay.member(m, x0, ctx.index() as u64, end));
                check(&relay.result.lock().expect("result"));
                taken_over += relay.taken_over.load(Ordering::Relaxed);
            }
        }
        _ => unreachable!(),
    }
    (tokens as f64 / t0.elapsed().as_secs_f64(), taken_over)
}

fn median_spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    // `-- --test` (every bench once, as a smoke test): a few tokens, one round.
    let smoke = args.iter().any(|a| a == "--test");
    let (tokens, rounds) = match smoke {
        true => (value("--tokens", 20), value("--rounds", 1)),
        false => (value("--tokens", 300), value("--rounds", 3)),
    };
    let load = args.iter().any(|a| a == "--background-load");
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global()
        .expect("a pool of two threads");
    let m = model();
    let x0: Vec<f32> = (0..576).map(|i| (i as f32 * 0.37).sin()).collect();
    let want = solo_token(&m, &x0);
    let designs = [
        "solo",
        "barrier",
        "relay",
        "relay-drain",
        "relay-drain-1/4",
        "relay-join",
    ];
    let mut rates = vec![Vec::new(); designs.len()];
    let mut busy: Option<Child> = load.then(|| {
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh for the background load")
    });
    for round in 1..=rounds {
        for (d, design) in designs.iter().enumerate() {
            let (rate, taken) = run_design(design, &m, &x0, &want, tokens);
            println!("round {round} {design:<15} {rate:7.1} tok/s  chunks taken over: {taken}");
            rates[d].push(rate);
        }
    }
    if let Some(b) = busy.as_mut() {
        let _ = b.kill();
        let _ = b.wait();
    }
    let load = if load { "one busy process" } else { "no load" };
    println!("\n{load}, {tokens} tokens, medians of {rounds} alternating rounds:");
    let solo = median_spread(&mut rates[0].clone()).0;
    for (design, r) in designs.iter().zip(&mut rates) {
        let (med, lo, hi) = median_spread(r);
        println!(
            "{design:<10} {med:7.1} tok/s ({lo:.0}–{hi:.0})  {:.2}× solo",
            med / solo
        );
    }
}
