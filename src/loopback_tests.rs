//! Protocol tests without mpirun: N ranks as N engines in this process, on the
//! loopback transport, with the real negotiation, cache, fusion and stall inspector.
//! Fast enough to run many random schedules; the real-MPI tests stay in
//! `tests/collectives`.

use std::time::Duration;

use crate::config::Config;
use crate::error::Error;
use crate::runtime::{spawn_engine, Kolo};
use crate::tensor::Tensor;
use crate::transport::loopback::{Loopback, Watchdog};
use crate::transport::Transport;
use crate::vocab::ReduceOp;

/// Starts `size` in-process ranks (all at once: starting needs every rank).
fn job(size: usize, config: impl Fn(usize) -> Config + Sync) -> Vec<Kolo> {
    start(Loopback::job(size), config)
}

/// Starts an engine on each of `ends` (all at once: starting needs every rank).
fn start(ends: Vec<Loopback>, config: impl Fn(usize) -> Config + Sync) -> Vec<Kolo> {
    let _watchdog = Watchdog::new("starting the ranks");
    std::thread::scope(|s| {
        let started: Vec<_> = ends
            .into_iter()
            .enumerate()
            .map(|(r, end)| {
                let config = config(r);
                s.spawn(move || {
                    spawn_engine(config, "kolo-engine".into(), None, None, move || {
                        Ok(Box::new(end) as Box<dyn Transport>)
                    })
                })
            })
            .collect();
        started
            .into_iter()
            .map(|h| match h.join() {
                Ok(Ok(k)) => k,
                Ok(Err(e)) => panic!("a rank did not start: {e}"),
                Err(_) => panic!("a rank panicked while starting"),
            })
            .collect()
    })
}

/// Runs `f(rank, kolo)` on every rank at once and returns the results in rank order.
fn on_every_rank<T: Send>(ranks: &[Kolo], f: impl Fn(usize, &Kolo) -> T + Sync) -> Vec<T> {
    let _watchdog = Watchdog::new("running the ranks");
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, k)| {
                let f = &f;
                s.spawn(move || f(r, k))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panic!("a rank panicked")))
            .collect()
    })
}

/// A small deterministic generator (xorshift) for schedules.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

fn values(t: Tensor) -> Vec<f32> {
    t.into_vec::<f32>().unwrap_or_default()
}

#[test]
fn out_of_order_submission_on_every_rank() {
    let ranks = job(3, |_| Config::default());
    let results = on_every_rank(&ranks, |r, k| {
        let mut order: Vec<usize> = (0..30).collect();
        Rng(r as u64 + 1).shuffle(&mut order);
        let handles: Vec<_> = order
            .iter()
            .map(|&i| {
                let t = Tensor::from_vec(vec![(r + 1) as f32 * i as f32; 3], &[3])
                    .unwrap_or_else(|e| panic!("{e}"));
                let h = k
                    .allreduce(format!("t{i}"), t)
                    .op(ReduceOp::Sum)
                    .submit()
                    .unwrap_or_else(|e| panic!("{e}"));
                (i, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(i, h)| (i, values(h.wait().unwrap_or_else(|e| panic!("t{i}: {e}")))))
            .collect::<Vec<_>>()
    });
    for (r, got) in results.iter().enumerate() {
        for (i, v) in got {
            assert_eq!(v, &vec![6.0 * *i as f32; 3], "rank {r}, t{i}");
        }
    }
}

/// Random orders, random delays and a random mix of collectives on every rank, for
/// many seeds: every op completes with the reference result and nothing hangs.
#[test]
fn random_schedules_agree_with_the_reference() {
    for seed in 1..=12u64 {
        let size = 2 + (seed % 3) as usize;
        let ranks = job(size, |_| Config::default());
        let n = 16;
        let results = on_every_rank(&ranks, |r, k| {
            let mut rng = Rng(seed * 7919 + r as u64);
            let mut order: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut order);
            let mut handles = Vec::new();
            for &i in &order {
                if rng.below(4) == 0 {
                    std::thread::sleep(Duration::from_micros(rng.below(300) as u64));
                }
                let t = Tensor::from_vec(vec![(r * 10 + i) as f32; 2], &[1, 2])
                    .unwrap_or_else(|e| panic!("{e}"));
                let name = format!("s{seed}.{i}");
                let h = match i % 3 {
                    0 => k.allreduce(name, t).op(ReduceOp::Sum).submit(),
                    1 => k.allgather(name, t).submit(),
                    _ => k.broadcast(name, t, i % size).submit(),
                }
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                handles.push((i, h));
            }
            let mut out: Vec<(usize, Vec<f32>)> = handles
                .into_iter()
                .map(|(i, h)| {
                    (
                        i,
                        values(h.wait().unwrap_or_else(|e| panic!("seed {seed}: {e}"))),
                    )
                })
                .collect();
            out.sort_by_key(|(i, _)| *i);
            out
        });
        for (r, got) in results.iter().enumerate() {
            for (i, v) in got {
                let want: Vec<f32> = match i % 3 {
                    0 => vec![(0..size).map(|q| (q * 10 + i) as f32).sum(); 2],
                    1 => (0..size).flat_map(|q| [(q * 10 + i) as f32; 2]).collect(),
                    _ => vec![((i % size) * 10 + i) as f32; 2],
                };
                assert_eq!(v, &want, "seed {seed}, rank {r}, op {i}");
            }
        }
    }
}

#[test]
fn a_rank_that_leaves_is_named_on_the_others() {
    let ranks = job(3, |_| Config::default());
    let errors = on_every_rank(&ranks, |r, k| {
        if r == 2 {
            k.shutdown().unwrap_or_else(|e| panic!("{e}"));
            return None;
        }
        let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
        k.allreduce("after.leave", t).wait().err()
    });
    for (r, e) in errors.iter().enumerate().take(2) {
        match e {
            Some(Error::RankLeft { rank: 2, .. }) => {}
            other => panic!("rank {r}: expected RankLeft naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn joined_ranks_contribute_zeros_and_join_names_the_last() {
    let ranks = job(3, |_| Config::default());
    let out = on_every_rank(&ranks, |r, k| {
        let mut sum = None;
        if r < 2 {
            let t = Tensor::from_vec(vec![1.0f32; 2], &[2]).unwrap_or_else(|e| panic!("{e}"));
            sum = Some(values(
                k.allreduce("j", t)
                    .op(ReduceOp::Sum)
                    .wait()
                    .unwrap_or_else(|e| panic!("{e}")),
            ));
        }
        if r == 1 {
            std::thread::sleep(Duration::from_millis(50));
        }
        (sum, k.join().unwrap_or_else(|e| panic!("{e}")))
    });
    for (r, (sum, last)) in out.iter().enumerate() {
        if r < 2 {
            assert_eq!(sum.as_deref(), Some(&[2.0f32, 2.0][..]), "rank {r}");
        }
        assert_eq!(*last, 1, "rank {r}: the last rank to join");
    }
}

#[test]
fn a_stall_names_the_missing_rank() {
    let ranks = job(2, |_| {
        Config::default()
            .stall_check_time(Duration::from_millis(200))
            .stall_shutdown_time(Duration::from_millis(600))
    });
    let out = on_every_rank(&ranks, |r, k| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
        k.allreduce("stalled", t)
            .wait()
            .err()
            .map(|e| e.to_string())
    });
    let msg = out[0].clone().unwrap_or_default();
    assert!(
        msg.contains("\"stalled\" is missing from ranks [1]"),
        "rank 0 got {msg:?}"
    );
}

/// The response cache: the same names every step (served from the cache after the
/// first), a name whose shape changes (its slot invalidated on every rank), and more
/// names than slots (evictions) all give the right sums.
#[test]
fn cache_hits_invalidation_and_eviction_keep_results_right() {
    for capacity in [1024, 2] {
        let ranks = job(3, |_| Config::default().cache_capacity(capacity));
        let out = on_every_rank(&ranks, |r, k| {
            let mut got = Vec::new();
            for step in 0..6 {
                // "w" changes shape on step 3; five names cycle through two slots.
                let len = if step < 3 { 2 } else { 5 };
                for name in ["w", "a", "b", "c", "d"] {
                    let len = if name == "w" { len } else { 3 };
                    let t = Tensor::from_vec(vec![(r + step) as f32; len], &[len])
                        .unwrap_or_else(|e| panic!("{e}"));
                    let v = k
                        .allreduce(name, t)
                        .op(ReduceOp::Sum)
                        .wait()
                        .unwrap_or_else(|e| {
                            panic!("capacity {capacity}, step {step}, {name}: {e}")
                        });
                    got.push((step, name, values(v)));
                }
            }
            got
        });
        for (r, got) in out.iter().enumerate() {
            for (step, name, v) in got {
                let len = if *name == "w" && *step < 3 {
                    2
                } else if *name == "w" {
                    5
                } else {
                    3
                };
                let want = vec![(3 * step + 3) as f32; len];
                assert_eq!(
                    v, &want,
                    "capacity {capacity}, rank {r}, step {step}, {name}"
                );
            }
        }
    }
}

/// The autotuner (rank 0) switches the settings of every rank at the end of the same
/// cycle: every rank reports the same list of changes.
#[test]
fn tuner_changes_apply_on_every_rank_in_the_same_cycle() {
    let ranks = job(2, |_| {
        Config::default()
            .autotune(true)
            .autotune_warmup_samples(1)
            .autotune_steps_per_sample(2)
            .autotune_max_samples(4)
            .simulated_collective_cost(Duration::from_micros(50))
    });
    let states = on_every_rank(&ranks, |r, k| {
        for step in 0..400 {
            let t = Tensor::from_vec(vec![r as f32; 64], &[64]).unwrap_or_else(|e| panic!("{e}"));
            k.allreduce(format!("g{}", step % 8), t)
                .op(ReduceOp::Sum)
                .wait()
                .unwrap_or_else(|e| panic!("{e}"));
            let done = k
                .broadcast_object("done", k.autotune_state().finished, 0)
                .unwrap_or_else(|e| panic!("{e}"));
            if done {
                break;
            }
        }
        k.autotune_state()
    });
    assert!(
        states[0].finished,
        "the tuner did not finish: {:?}",
        states[0]
    );
    assert!(!states[0].changes.is_empty(), "no change was applied");
    assert_eq!(
        states[0].changes, states[1].changes,
        "ranks switched settings at different cycles"
    );
}

mod algorithms;
mod driving;
mod gpu;
