//! kolo against plain MPI, on the same data.
//!
//! `cargo bench --bench kolo_vs_mpi` launches itself under `mpirun -np 2` and then
//! `-np 4` (`-- --np 2` for one size; `-- --quick` for fewer repetitions; `-- --only 3`
//! or `--only 1,3,4` for some scenarios; `KOLO_BENCH_REPS=N` timed repetitions per
//! launch, default 9;
//! `KOLO_BENCH_ROUNDS=N` launches of each side, default 3; `KOLO_BENCH_BIND=core` binds
//! each rank to a core, as Open MPI does by default for up to 2 ranks, instead of
//! `--bind-to none`), prints a table of medians with ratios and writes the same to
//! `target/kolo-bench-np<N>.json`.
//! `scripts/run-bench.sh` sets OpenMPI up first.
//!
//! `-- --hosts H` runs across the emulated hosts of `scripts/multinode` (set up first,
//! as `scripts/run-multinode-bench.sh` does): `np / H` ranks per host, kolo's settings
//! forwarded to remote ranks. With more than one rank per host a third side runs: kolo
//! with `KOLO_HIERARCHICAL_ALLREDUCE=1` and `KOLO_HIERARCHICAL_ALLGATHER=1` (every
//! size), reported against plain MPI and against kolo's defaults (`hier/kolo`: the
//! allreduce is hierarchical from 2 MiB there by default, flat below).
//!
//! **The baseline is a separate plain MPI program**: the same binary launched with
//! `--plain`, which calls `MPI_Init` itself and never starts kolo (no engine thread, no
//! `MPI_THREAD_MULTIPLE`), i.e. what a user would otherwise write. Kolo launches and
//! plain launches alternate (`KOLO_BENCH_ROUNDS` of each, the order swapped every
//! round), so that both see the same machine load over time. The kolo launches also
//! time the same raw MPI calls inside the kolo process, with kolo's ways interleaved
//! repetition by repetition; that column shows how much a live engine thread slows
//! raw MPI in its own process, and is not the baseline.
//!
//! Inputs are prepared outside the timed region on both sides: what is timed is
//! submission, negotiation, fusion and the collectives.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use kolo::{Kolo, ReduceOp, Tensor};

// The tests' mpirun launcher; the benchmark uses only its environment defaults.
mod common;

#[path = "../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;
use mpi::ffi;

extern "C" {
    // From kolo's C shim: the real MPI_IN_PLACE of the linked MPI.
    fn kolo_mpi_in_place() -> *mut c_void;
}

fn world() -> ffi::MPI_Comm {
    // SAFETY: reading MPI's constant world communicator handle after MPI_Init.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

fn raw_barrier() {
    // SAFETY: a plain barrier on MPI_COMM_WORLD; kolo never uses that communicator.
    unsafe { ffi::MPI_Barrier(world()) };
}

fn world_rank_size() -> (usize, usize) {
    let (mut rank, mut size) = (0, 0);
    // SAFETY: MPI is initialised; both calls write one int each.
    unsafe {
        ffi::MPI_Comm_rank(world(), &mut rank);
        ffi::MPI_Comm_size(world(), &mut size);
    }
    (rank as usize, size as usize)
}

/// MPI_Allgather of f32s: `out` holds `send.len()` elements per rank.
fn raw_allgather(send: &[f32], out: &mut [f32]) {
    // SAFETY: `send` and `out` are valid for the counts passed.
    unsafe {
        ffi::MPI_Allgather(
            send.as_ptr().cast(),
            send.len() as i32,
            ffi::RSMPI_FLOAT,
            out.as_mut_ptr().cast(),
            send.len() as i32,
            ffi::RSMPI_FLOAT,
            world(),
        );
    }
}

/// MPI_Allreduce(SUM) of f32s, in place or out of place.
fn raw_allreduce(buf: &mut [f32], in_place: bool, scratch: &mut Vec<f32>) {
    // SAFETY: buffers are valid for `buf.len()` f32s for the duration of the call.
    unsafe {
        if in_place {
            ffi::MPI_Allreduce(
                kolo_mpi_in_place(),
                buf.as_mut_ptr().cast(),
                buf.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                world(),
            );
        } else {
            scratch.resize(buf.len(), 0.0);
            ffi::MPI_Allreduce(
                buf.as_ptr().cast(),
                scratch.as_mut_ptr().cast(),
                buf.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                world(),
            );
            buf.copy_from_slice(scratch);
        }
    }
}

/// MPI_Send of bytes to `dest` on MPI_COMM_WORLD (the plain program's point to point).
fn raw_send(buf: &[u8], dest: usize) {
    // SAFETY: `buf` is valid for its length; a blocking send.
    unsafe {
        ffi::MPI_Send(
            buf.as_ptr().cast(),
            buf.len() as i32,
            ffi::RSMPI_UINT8_T,
            dest as i32,
            5,
            world(),
        )
    };
}

/// MPI_Recv of bytes from `src` on MPI_COMM_WORLD.
fn raw_recv(buf: &mut [u8], src: usize) {
    // SAFETY: `buf` is valid for its length; a blocking receive.
    unsafe {
        ffi::MPI_Recv(
            buf.as_mut_ptr().cast(),
            buf.len() as i32,
            ffi::RSMPI_UINT8_T,
            src as i32,
            5,
            world(),
            ffi::RSMPI_STATUS_IGNORE,
        )
    };
}

/// One ping-pong of `bytes` between ranks 0 and 1 (others idle), timed on rank 0 and
/// halved: the one-way time of a message. `kolo` sends through kolo, else plain MPI.
fn ping_pong<'a>(k: Option<&'a Kolo>, bytes: usize) -> Way<'a> {
    let (rank, _) = world_rank_size();
    Box::new(move || {
        let mut buf = vec![1u8; bytes];
        raw_barrier();
        let t = Instant::now();
        match (k, rank) {
            (Some(k), 0) => {
                let out = Tensor::from_vec(buf, &[bytes]).expect("tensor");
                k.send("pp", out, 1).wait().expect("send");
                k.recv("pp.back", 1).wait().expect("recv");
            }
            (Some(k), 1) => {
                let got = k.recv("pp", 0).wait().expect("recv");
                k.send("pp.back", got, 0).wait().expect("send");
            }
            (None, 0) => {
                raw_send(&buf, 1);
                raw_recv(&mut buf, 1);
            }
            (None, 1) => {
                raw_recv(&mut buf, 0);
                raw_send(&buf, 0);
            }
            _ => {}
        }
        t.elapsed().as_secs_f64() / 2.0
    })
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

/// One way of running a scenario (kolo, or a raw MPI baseline): an untimed setup
/// that prepares the data the run consumes, so that neither side is charged for
/// copying its inputs, then the timed run, every rank starting together.
type Way<'a> = Box<dyn FnMut() -> f64 + 'a>;

fn way<'a, T>(mut setup: impl FnMut() -> T + 'a, mut run: impl FnMut(T) + 'a) -> Way<'a> {
    Box::new(move || {
        let input = setup();
        raw_barrier();
        let t = Instant::now();
        run(input);
        t.elapsed().as_secs_f64()
    })
}

/// Runs every way `warmup` times untimed, then `reps` rounds in which each way runs
/// once in turn, and returns each way's times. Alternating the ways, rather than
/// timing one in a block and then the next, exposes them to the same machine load.
fn interleaved(reps: usize, warmup: usize, ways: &mut [(&'static str, Way<'_>)]) -> Vec<Vec<f64>> {
    for (_, w) in ways.iter_mut() {
        for _ in 0..warmup {
            w();
        }
    }
    let mut times = vec![Vec::with_capacity(reps); ways.len()];
    for _ in 0..reps {
        for ((_, w), t) in ways.iter_mut().zip(&mut times) {
            t.push(w());
        }
    }
    times
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// One tensor per buffer (copied), each of shape `shape(len)`: the untimed input of
/// kolo's ways.
fn tensors_of(data: &[Vec<f32>], shape: impl Fn(usize) -> Vec<usize>) -> Vec<Tensor> {
    data.iter()
        .map(|d| Tensor::from_vec(d.clone(), &shape(d.len())).expect("tensor"))
        .collect()
}

/// Kolo's per-tensor way: every tensor submitted as an async Sum allreduce named
/// `<prefix>.<index>` (last first with `backward`, as gradients arrive), then all waited.
fn allreduce_each(k: &Kolo, prefix: &str, ts: Vec<Tensor>, backward: bool) -> kolo::Result<()> {
    let mut named: Vec<(usize, Tensor)> = ts.into_iter().enumerate().collect();
    if backward {
        named.reverse();
    }
    let mut hs = Vec::with_capacity(named.len());
    for (i, t) in named {
        hs.push(
            k.allreduce(format!("{prefix}.{i}"), t)
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    for h in hs {
        h.wait()?;
    }
    Ok(())
}

/// Every timed sample of one launch, keyed `"<scenario>|<way>"`.
type Samples = BTreeMap<String, Vec<f64>>;

/// Runs the ways of scenario `n` (interleaved, after `warmup` untimed runs of each) and
/// records their times under `"<n>|<way>"`.
fn record(
    samples: &mut Samples,
    n: &str,
    reps: usize,
    warmup: usize,
    mut ways: Vec<(&'static str, Way<'_>)>,
) {
    let times = interleaved(reps, warmup, &mut ways);
    for ((label, _), t) in ways.iter().zip(times) {
        samples.insert(format!("{n}|{label}"), t);
    }
}

/// The scenarios. With `k` (a kolo rank) kolo's ways run interleaved with the raw
/// ones; without (the plain MPI program) only the raw ways run.
fn bench(k: Option<&Kolo>, reps: usize, quick: bool, only: Option<&[u32]>) -> Samples {
    let run = |n: u32| only.is_none_or(|o| o.contains(&n));
    let mut samples = Samples::new();
    let (_, size) = world_rank_size();

    // 1. Latency of one 4-byte allreduce.
    if run(1) {
        let n_lat = if quick { 200 } else { 2000 };
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push((
                "kolo",
                way(
                    || Tensor::from_vec(vec![1.0f32], &[1]).expect("tensor"),
                    |t| {
                        k.allreduce("lat", t)
                            .op(ReduceOp::Sum)
                            .wait()
                            .expect("allreduce");
                    },
                ),
            ));
        }
        ways.push((
            "raw",
            way(
                || [1.0f32],
                |mut x| raw_allreduce(&mut x, true, &mut Vec::new()),
            ),
        ));
        record(&mut samples, "1", n_lat, 50, ways);
    }

    // 2. 1000 tensors of 256 floats submitted async, then waited. Inputs are built
    // outside the timed region on both sides.
    if run(2) {
        let data: Vec<Vec<f32>> = (0..1000).map(|i| vec![i as f32; 256]).collect();
        let tensors = || tensors_of(&data, |n| vec![n]);
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push((
                "kolo",
                way(tensors, |ts| {
                    allreduce_each(k, "many", ts, false).expect("allreduce");
                }),
            ));
            // The same tensors as one grouped allreduce: one submit, one handle, one
            // negotiation entry. Names are made in the timed region, as above.
            ways.push((
                "kolo grouped",
                way(tensors, |ts| {
                    let named = ts
                        .into_iter()
                        .enumerate()
                        .map(|(i, t)| (format!("many.{i}"), t))
                        .collect();
                    let outs = k.grouped_allreduce(named).op(ReduceOp::Sum).wait();
                    drop(outs.expect("grouped allreduce"));
                }),
            ));
        }
        ways.push((
            "raw",
            way(
                || data.clone(),
                |mut d| {
                    for d in &mut d {
                        raw_allreduce(d, true, &mut Vec::new());
                    }
                },
            ),
        ));
        record(&mut samples, "2", reps, 2, ways);
    }

    // 3. The ResNet-50 gradient set, in reverse (backward) order.
    if run(3) {
        let sizes = common::resnet50_sizes();
        let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5f32; n]).collect();
        let tensors = || tensors_of(&grads, |n| vec![n]);
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push((
                "kolo",
                way(tensors, |ts| {
                    allreduce_each(k, "rn50", ts, true).expect("allreduce");
                }),
            ));
        }
        let per_tensor = |in_place: bool| {
            let mut scratch = Vec::new();
            way(
                || grads.clone(),
                move |mut gs: Vec<Vec<f32>>| {
                    for g in gs.iter_mut().rev() {
                        raw_allreduce(g, in_place, &mut scratch);
                    }
                },
            )
        };
        let total: usize = sizes.iter().sum();
        let mut packed = vec![0.5f32; total];
        ways.push(("raw in place", per_tensor(true)));
        ways.push(("raw out of place", per_tensor(false)));
        ways.push((
            "raw packed",
            way(
                || (),
                move |()| raw_allreduce(&mut packed, true, &mut Vec::new()),
            ),
        ));
        record(&mut samples, "3", reps, 2, ways);
    }

    // 4. One 64 MiB tensor.
    if run(4) {
        let big = vec![0.25f32; 16 << 20];
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push((
                "kolo",
                way(
                    || Tensor::from_vec(big.clone(), &[big.len()]).expect("tensor"),
                    |t| {
                        k.allreduce("big", t)
                            .op(ReduceOp::Sum)
                            .wait()
                            .expect("allreduce");
                    },
                ),
            ));
        }
        let raw_way = |in_place: bool| {
            let mut scratch = Vec::new();
            way(
                || big.clone(),
                move |mut b: Vec<f32>| raw_allreduce(&mut b, in_place, &mut scratch),
            )
        };
        ways.push(("raw in place", raw_way(true)));
        ways.push(("raw out of place", raw_way(false)));
        record(&mut samples, "4", reps, 1, ways);
    }

    // 6. 1000 small allgathers (64 f32 per rank each) submitted async, then waited;
    // kolo fuses them into a few MPI_Allgatherv calls.
    if run(6) {
        let data: Vec<Vec<f32>> = (0..1000).map(|i| vec![i as f32; 64]).collect();
        let tensors = || tensors_of(&data, |n| vec![1, n]);
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push((
                "kolo",
                way(tensors, |ts| {
                    let hs: Vec<_> = ts
                        .into_iter()
                        .enumerate()
                        .map(|(i, t)| k.allgather(format!("ag.{i}"), t).submit().expect("submit"))
                        .collect();
                    hs.into_iter().for_each(|h| drop(h.wait().expect("wait")));
                }),
            ));
        }
        let mut out = vec![0f32; 64 * size];
        let data = &data;
        ways.push((
            "raw",
            way(
                || (),
                move |()| {
                    for d in data {
                        raw_allgather(d, &mut out);
                    }
                },
            ),
        ));
        record(&mut samples, "6", reps, 2, ways);
    }

    // 7. Point to point between ranks 0 and 1: 4 bytes and 16 MiB, one way (half a
    // ping-pong), against MPI_Send/MPI_Recv.
    if run(7) && size >= 2 {
        let n_pp = if quick { 100 } else { 1000 };
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push(("kolo", ping_pong(Some(k), 4)));
        }
        ways.push(("raw", ping_pong(None, 4)));
        record(&mut samples, "7", n_pp, 20, ways);
        let mut ways = Vec::new();
        if let Some(k) = k {
            ways.push(("kolo", ping_pong(Some(k), 16 << 20)));
        }
        ways.push(("raw", ping_pong(None, 16 << 20)));
        // 30 untimed legs first, for every way: on this VM a 16 MiB copy between two
        // processes speeds up over the first 15-30 legs of a process (a plain C
        // ping-pong: 4.4 ms -> 1.8 ms over 15 legs; a kolo process, which has touched
        // more fresh memory, longer), so with 2 the row measured that warm-up. And at
        // least 40 timed legs: a leg is ~2 ms, and 9 of them still sampled the end of
        // the warm-up (kolo's legs 1.14-1.18x raw MPI calls in the same process over
        // 9, 0.91-0.92x over 60).
        record(&mut samples, "7b", reps.max(40), 30, ways);
    }

    // 5. Engine CPU: idle, and waiting for a rank that sleeps 2 s (kolo only).
    if let (true, Some(k)) = (run(5), k) {
        let idle = if quick { 2.0 } else { 10.0 };
        raw_barrier();
        let c0 = cpu_seconds();
        std::thread::sleep(Duration::from_secs_f64(idle));
        samples.insert("5|idle".into(), vec![(cpu_seconds() - c0) / idle]);
        raw_barrier();
        let c0 = cpu_seconds();
        let t0 = Instant::now();
        if k.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
        }
        k.allreduce(
            "late",
            Tensor::from_vec(vec![1.0f32], &[1]).expect("tensor"),
        )
        .wait()
        .expect("allreduce");
        samples.insert(
            "5|wait".into(),
            vec![(cpu_seconds() - c0) / t0.elapsed().as_secs_f64()],
        );
    }
    samples
}

/// `KOLO_BENCH_RESNET=<reps>`: only the ResNet-50 set, under whatever KOLO_* settings
/// the environment gives (`scripts/run-tuning-grid.sh` runs it per grid point). With
/// KOLO_AUTOTUNE=1 it first runs steps until the tuner has finished (at most 300 s).
/// Prints `RESNET_MS <median step>` on rank 0.
fn resnet_worker(reps: usize) -> anyhow::Result<()> {
    let k = kolo::init()?;
    let grads: Vec<Vec<f32>> = common::resnet50_sizes()
        .iter()
        .map(|&n| vec![0.5f32; n])
        .collect();
    let step = |k: &Kolo| allreduce_each(k, "rn50", tensors_of(&grads, |n| vec![n]), true);
    let deadline = Instant::now() + std::time::Duration::from_secs(300);
    let mut tuning_steps = 0;
    while k.autotune_state().enabled {
        step(&k)?;
        tuning_steps += 1;
        let done = k.broadcast_object("tuned", k.autotune_state().finished, 0)?;
        if done || Instant::now() > deadline {
            break;
        }
    }
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps + 3 {
        raw_barrier();
        let t = Instant::now();
        step(&k)?;
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    if k.rank() == 0 {
        let s = k.autotune_state();
        println!(
            "RESNET_MS {:.3} tuning_steps {tuning_steps} threshold {} cycle_us {} cache {}",
            median(&times) * 1e3,
            s.fusion_threshold,
            s.cycle_time.as_micros(),
            s.cache_enabled
        );
    }
    k.shutdown()?;
    Ok(())
}

/// Options every launch is given.
struct Opts {
    quick: bool,
    only: Option<Vec<u32>>,
    reps: usize,
    /// Across this many emulated hosts (`--hosts`), or on this machine (None).
    hosts: Option<usize>,
}

/// Which program a launch runs: kolo (flat or hierarchical allreduce) or plain MPI.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    Kolo,
    Hierarchical,
    Plain,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Kolo => "kolo",
            Side::Hierarchical => "kolo-hier",
            Side::Plain => "plain",
        }
    }
}

/// One rank of a launch: a kolo rank, or (`plain`) a plain MPI program. Rank 0
/// writes the samples to `KOLO_BENCH_OUT`.
fn worker(plain: bool, o: &Opts) -> anyhow::Result<()> {
    let out = std::env::var("KOLO_BENCH_OUT").unwrap_or_else(|_| "/dev/null".into());
    let (rank, samples) = if plain {
        let universe =
            mpi::initialize().ok_or_else(|| anyhow::anyhow!("MPI was already initialised"))?;
        let samples = bench(None, o.reps, o.quick, o.only.as_deref());
        let rank = world_rank_size().0;
        drop(universe);
        (rank, samples)
    } else {
        let k = kolo::init()?;
        let samples = bench(Some(&k), o.reps, o.quick, o.only.as_deref());
        k.shutdown()?;
        (k.rank(), samples)
    };
    if rank == 0 {
        std::fs::write(&out, serde_json::to_string(&samples)?)?;
    }
    Ok(())
}

/// One table row: which samples it compares and how.
struct Row {
    scenario: &'static str,
    kolo: &'static str,
    raw: &'static str,
    baseline: &'static str,
    /// The percentile reported (0.5 = median).
    p: f64,
}

const ROWS: &[Row] = &[
    Row {
        scenario: "1. 4-byte allreduce latency p50",
        kolo: "1|kolo",
        raw: "1|raw",
        baseline: "MPI_Allreduce in place",
        p: 0.5,
    },
    Row {
        scenario: "1. 4-byte allreduce latency p99",
        kolo: "1|kolo",
        raw: "1|raw",
        baseline: "MPI_Allreduce in place",
        p: 0.99,
    },
    Row {
        scenario: "2. 1000 x 256 f32, async",
        kolo: "2|kolo",
        raw: "2|raw",
        baseline: "per-tensor loop in place",
        p: 0.5,
    },
    Row {
        scenario: "2b. the same as one grouped_allreduce",
        kolo: "2|kolo grouped",
        raw: "2|raw",
        baseline: "per-tensor loop in place",
        p: 0.5,
    },
    Row {
        scenario: "3. ResNet-50 set (161 tensors, 25.56 M floats)",
        kolo: "3|kolo",
        raw: "3|raw in place",
        baseline: "per-tensor loop in place",
        p: 0.5,
    },
    Row {
        scenario: "3. ResNet-50 set (161 tensors, 25.56 M floats)",
        kolo: "3|kolo",
        raw: "3|raw out of place",
        baseline: "per-tensor loop out of place",
        p: 0.5,
    },
    Row {
        scenario: "3. ResNet-50 set (161 tensors, 25.56 M floats)",
        kolo: "3|kolo",
        raw: "3|raw packed",
        baseline: "one pre-packed allreduce in place",
        p: 0.5,
    },
    Row {
        scenario: "4. one 64 MiB f32 tensor",
        kolo: "4|kolo",
        raw: "4|raw in place",
        baseline: "MPI_Allreduce in place",
        p: 0.5,
    },
    Row {
        scenario: "4. one 64 MiB f32 tensor",
        kolo: "4|kolo",
        raw: "4|raw out of place",
        baseline: "MPI_Allreduce out of place",
        p: 0.5,
    },
    Row {
        scenario: "7. send/recv 4 B, one way (ping-pong / 2)",
        kolo: "7|kolo",
        raw: "7|raw",
        baseline: "MPI_Send/MPI_Recv",
        p: 0.5,
    },
    Row {
        scenario: "7b. send/recv 16 MiB, one way",
        kolo: "7b|kolo",
        raw: "7b|raw",
        baseline: "MPI_Send/MPI_Recv",
        p: 0.5,
    },
    Row {
        scenario: "6. 1000 x 64 f32 allgather, async",
        kolo: "6|kolo",
        raw: "6|raw",
        baseline: "per-tensor MPI_Allgather loop",
        p: 0.5,
    },
];

/// Every launch's samples of `key`, and the percentile over all of them.
fn pooled(launches: &[Samples], key: &str, p: f64) -> Option<f64> {
    let all: Vec<f64> = launches
        .iter()
        .filter_map(|s| s.get(key))
        .flatten()
        .copied()
        .collect();
    (!all.is_empty()).then(|| percentile(&all, p))
}

/// Prints the table for one configuration and writes it as JSON. `hier` (launches of
/// kolo with the hierarchical allreduce) may be empty.
fn report(
    what: &str,
    tag: &str,
    kolo: &[Samples],
    hier: &[Samples],
    plain: &[Samples],
) -> anyhow::Result<()> {
    println!(
        "\nkolo vs plain MPI, {what}, {} launches of each, medians over all (rank 0's clock)",
        kolo.len()
    );
    print!(
        "{:<48} {:>10} {:>10} {:>6} {:>13} {:>10} {:>6}",
        "scenario", "kolo", "plain MPI", "ratio", "[range]", "raw in kolo", "ratio"
    );
    if !hier.is_empty() {
        print!(" {:>10} {:>6} {:>9}", "kolo hier", "ratio", "hier/kolo");
    }
    println!("  baseline");
    // Per launch pair: the ratio of `a`'s percentile of `ka` to `b`'s of `kb`.
    let range = |a: &[Samples], ka: &str, b: &[Samples], kb: &str, p: f64| {
        let r: Vec<f64> = a
            .iter()
            .zip(b)
            .filter_map(|(x, y)| Some(percentile(x.get(ka)?, p) / percentile(y.get(kb)?, p)))
            .collect();
        let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.iter().copied().fold(0.0, f64::max);
        (lo, hi)
    };
    let mut json = Vec::new();
    for r in ROWS {
        let (Some(kv), Some(pv)) = (pooled(kolo, r.kolo, r.p), pooled(plain, r.raw, r.p)) else {
            continue;
        };
        let (lo, hi) = range(kolo, r.kolo, plain, r.raw, r.p);
        let inproc = pooled(kolo, r.raw, r.p).unwrap_or(f64::NAN);
        print!(
            "{:<48} {:>10} {:>10} {:>6.2} {:>13} {:>10} {:>6.2}",
            r.scenario,
            common::fmt_time(kv),
            common::fmt_time(pv),
            kv / pv,
            format!("[{lo:.2}-{hi:.2}]"),
            common::fmt_time(inproc),
            kv / inproc,
        );
        let mut row = serde_json::json!({
            "config": what, "scenario": r.scenario, "baseline": r.baseline, "kolo": kv,
            "plain_mpi": pv, "ratio": kv / pv, "ratio_min": lo, "ratio_max": hi,
            "raw_in_kolo_process": inproc, "ratio_in_kolo_process": kv / inproc,
        });
        if let Some(hv) = pooled(hier, r.kolo, r.p) {
            let (hlo, hhi) = range(hier, r.kolo, kolo, r.kolo, r.p);
            print!(
                " {:>10} {:>6.2} {:>9}",
                common::fmt_time(hv),
                hv / pv,
                format!("{:.2}[{hlo:.2}-{hhi:.2}]", hv / kv)
            );
            row["kolo_hierarchical"] = hv.into();
            row["hierarchical_vs_default"] = (hv / kv).into();
            row["hierarchical_vs_default_min"] = hlo.into();
            row["hierarchical_vs_default_max"] = hhi.into();
        }
        println!("  {}", r.baseline);
        json.push(row);
    }
    for (key, what) in [
        (
            "5|idle",
            "5. kolo process CPU while idle (fraction of a core)",
        ),
        (
            "5|wait",
            "5. rank 0 CPU while waiting 2 s for rank 1 (fraction of a core)",
        ),
    ] {
        if let Some(v) = pooled(kolo, key, 0.5) {
            println!("{what:<48} {v:>10.4}");
            json.push(serde_json::json!({ "scenario": what, "kolo": v }));
        }
    }
    let path = format!(
        "{}/kolo-bench-{tag}.json",
        env!("CARGO_TARGET_TMPDIR").trim_end_matches("/tmp")
    );
    std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    println!("written to {path}");
    Ok(())
}

/// Launches one side under mpirun and returns rank 0's samples.
fn launch(np: usize, side: Side, o: &Opts, round: usize) -> anyhow::Result<Samples> {
    let exe = std::env::current_exe()?;
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kolo-bench-{}-np{np}-{round}.json", side.label()));
    let _ = std::fs::remove_file(&out);
    let out_s = out.to_string_lossy().into_owned();
    let reps = o.reps.to_string();
    let mut env: Vec<(String, String)> = vec![
        ("KOLO_BENCH_OUT".into(), out_s),
        ("KOLO_BENCH_REPS".into(), reps),
    ];
    if side == Side::Hierarchical {
        env.push(("KOLO_HIERARCHICAL_ALLREDUCE".into(), "1".into()));
        env.push(("KOLO_HIERARCHICAL_ALLGATHER".into(), "1".into()));
    }
    let mut cmd = match o.hosts {
        None => {
            let mut cmd = std::process::Command::new("mpirun");
            // `KOLO_BENCH_BIND=core`: each rank (and kolo's engine thread with it) on
            // a core of its own, as Open MPI binds by default for up to 2 ranks.
            let bind = std::env::var("KOLO_BENCH_BIND").unwrap_or_else(|_| "none".into());
            cmd.args(["-np", &np.to_string(), "--bind-to", &bind]);
            // The same defaults as the tests' launcher, so that a bare `cargo bench` works.
            harness::mpi_env(&mut cmd);
            cmd
        }
        Some(hosts) => {
            let scripts = harness::multinode_scripts()
                .ok_or_else(|| anyhow::anyhow!("scripts/multinode is missing"))?;
            let mut cmd = std::process::Command::new(scripts.join("mpirun.sh"));
            cmd.args([
                "-np",
                &np.to_string(),
                "--map-by",
                &format!("ppr:{}:node", np / hosts),
            ]);
            // Remote ranks start from a bare environment: forward kolo's settings.
            let inherited = std::env::vars()
                .filter(|(k, _)| k.starts_with("KOLO_") || k == "RAYON_NUM_THREADS");
            for (k, _) in inherited.collect::<Vec<_>>().iter().chain(&env) {
                cmd.args(["-x", k]);
            }
            cmd
        }
    };
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.arg(&exe);
    if side == Side::Plain {
        cmd.arg("--plain");
    }
    if o.quick {
        cmd.arg("--quick");
    }
    if let Some(only) = &o.only {
        let list: Vec<String> = only.iter().map(u32::to_string).collect();
        cmd.args(["--only", &list.join(",")]);
    }
    let status = cmd.status()?;
    anyhow::ensure!(
        status.success(),
        "mpirun -np {np} ({}) failed: {status}",
        side.label()
    );
    Ok(serde_json::from_str(&std::fs::read_to_string(&out)?)?)
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this binary without
    // it: then only a short smoke run checks that the benchmark still works.
    let under_mpirun = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
    let smoke = !args.iter().any(|a| a == "--bench") && !under_mpirun;
    let quick = smoke || args.iter().any(|a| a == "--quick");
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let only = value("--only")
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
        .or(if smoke { Some(vec![1]) } else { None });
    let opts = Opts {
        quick,
        only,
        reps: env_usize("KOLO_BENCH_REPS").unwrap_or(if quick { 5 } else { 9 }),
        hosts: value("--hosts").and_then(|v| v.parse().ok()),
    };
    if under_mpirun {
        if let Some(reps) = env_usize("KOLO_BENCH_RESNET") {
            return resnet_worker(reps);
        }
        return worker(args.iter().any(|a| a == "--plain"), &opts);
    }
    let nps: Vec<usize> = match value("--np") {
        Some(n) => vec![n.parse()?],
        None if smoke => vec![2],
        None => vec![2, 4],
    };
    let rounds = env_usize("KOLO_BENCH_ROUNDS").unwrap_or(if quick { 1 } else { 3 });
    for np in nps {
        let (what, tag) = match opts.hosts {
            None => (format!("np={np}"), format!("np{np}")),
            Some(h) => {
                anyhow::ensure!(
                    h > 0 && np % h == 0,
                    "--np {np} does not split evenly over --hosts {h}"
                );
                (
                    format!("np={np} across {h} hosts x {}", np / h),
                    format!("np{np}-{h}hosts"),
                )
            }
        };
        let mut sides = vec![Side::Kolo, Side::Plain];
        if opts.hosts.is_some_and(|h| np / h > 1) {
            sides.insert(1, Side::Hierarchical);
        }
        let mut samples: Vec<Vec<Samples>> = vec![Vec::new(); sides.len()];
        for round in 0..rounds {
            // Alternate the order, so that no side always meets a warmer machine.
            let mut order: Vec<usize> = (0..sides.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                samples[i].push(launch(np, sides[i], &opts, round)?);
            }
        }
        let get = |s: Side| {
            sides
                .iter()
                .position(|&x| x == s)
                .map_or(Vec::new(), |i| samples[i].clone())
        };
        report(
            &what,
            &tag,
            &get(Side::Kolo),
            &get(Side::Hierarchical),
            &get(Side::Plain),
        )?;
    }
    Ok(())
}
