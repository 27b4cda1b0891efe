//! Issue 34: a thread blocked on its own op runs the engine's cycles itself while the
//! engine is idle (`engine::Driver`). These tests run several threads per rank against
//! it: nothing lost, nothing run twice, every result right, no hang.

use std::time::Duration;

use super::{job, on_every_rank, values};
use crate::config::Config;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;

/// Threads of one rank each submit and wait at once, by name, in their own order.
#[test]
fn threads_of_one_rank_drive_in_turn_and_every_result_is_right() {
    let ranks = job(2, |_| Config::default());
    let sums = on_every_rank(&ranks, |r, k| {
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|thread| {
                    s.spawn(move || {
                        (0..100)
                            .map(|i| {
                                let t = Tensor::from_vec(vec![(r + 1) as f32, i as f32], &[2])
                                    .unwrap_or_else(|e| panic!("{e}"));
                                let out = k
                                    .allreduce(format!("t{thread}.{i}"), t)
                                    .op(ReduceOp::Sum)
                                    .wait()
                                    .unwrap_or_else(|e| panic!("t{thread}.{i}: {e}"));
                                values(out)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| panic!("a thread panicked")))
                .collect::<Vec<_>>()
        })
    });
    for (r, per_thread) in sums.iter().enumerate() {
        for (thread, outs) in per_thread.iter().enumerate() {
            for (i, v) in outs.iter().enumerate() {
                assert_eq!(v, &[3.0, 2.0 * i as f32], "rank {r}, t{thread}.{i}");
            }
        }
    }
    let drives: Vec<u64> = ranks.iter().map(|k| k.caller_drives()).collect();
    assert!(
        drives.iter().all(|&d| d > 0),
        "no caller drove the engine: {drives:?}"
    );
}

/// While one thread drives the engine with blocking calls, another submits ops
/// asynchronously and waits for them later: the driver runs those too (or leaves them
/// to the engine thread), and all complete.
#[test]
fn a_driving_thread_also_runs_another_threads_async_ops() {
    let ranks = job(2, |_| Config::default());
    let out = on_every_rank(&ranks, |r, k| {
        std::thread::scope(|s| {
            let blocking = s.spawn(move || {
                for i in 0..200 {
                    let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
                    let v = values(
                        k.allreduce(format!("b.{i}"), t)
                            .op(ReduceOp::Sum)
                            .wait()
                            .unwrap_or_else(|e| panic!("{e}")),
                    );
                    assert_eq!(v, [2.0], "b.{i}");
                }
            });
            let handles: Vec<_> = (0..50)
                .map(|i| {
                    let t = Tensor::from_vec(vec![r as f32 + i as f32], &[1])
                        .unwrap_or_else(|e| panic!("{e}"));
                    k.allreduce(format!("a.{i}"), t)
                        .op(ReduceOp::Sum)
                        .submit()
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect();
            std::thread::sleep(Duration::from_millis(5));
            let sums: Vec<f32> = handles
                .into_iter()
                .map(|h| values(h.wait().unwrap_or_else(|e| panic!("{e}")))[0])
                .collect();
            blocking
                .join()
                .unwrap_or_else(|_| panic!("the blocking thread panicked"));
            sums
        })
    });
    for sums in out {
        let want: Vec<f32> = (0..50).map(|i| 1.0 + 2.0 * i as f32).collect();
        assert_eq!(sums, want);
    }
}

/// A caller drives the engine while it waits for an op no other rank submits; another
/// thread shuts this rank down meanwhile: the waiting op fails naming the shutdown,
/// the other rank hears that this one left, and nothing hangs.
#[test]
fn shutdown_while_a_caller_drives_fails_its_op_and_stops() {
    let ranks = job(2, |_| Config::default());
    let errors = on_every_rank(&ranks, |r, k| {
        if r == 0 {
            std::thread::scope(|s| {
                let waiter = s.spawn(move || {
                    let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
                    k.allreduce("never", t).wait().err().map(|e| e.to_string())
                });
                // Let the waiter start driving (it paces cycles while rank 1 is silent).
                while k.caller_drives() == 0 {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(20));
                k.shutdown().unwrap_or_else(|e| panic!("{e}"));
                waiter
                    .join()
                    .unwrap_or_else(|_| panic!("the waiter panicked"))
            })
        } else {
            // Rank 1 submits something else and learns that rank 0 left.
            let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
            let e = k.allreduce("other", t).wait().err().map(|e| e.to_string());
            k.shutdown().unwrap_or_else(|e| panic!("{e}"));
            e
        }
    });
    let rank0 = errors[0].as_deref().unwrap_or("it succeeded");
    assert!(rank0.contains("shut down"), "rank 0: {rank0}");
    let rank1 = errors[1].as_deref().unwrap_or("it succeeded");
    assert!(rank1.contains("rank 0 has shut down"), "rank 1: {rank1}");
}

/// An op submitted asynchronously while the engine is idle is left to its caller for
/// at most a cycle time (the engine thread's grace); one that nobody waits for still
/// runs on the engine thread: every rank polls its handle without waiting, and all
/// complete within a few cycle times. With a cycle time of 20 ms they do not complete
/// within the first 5 ms (the grace is the cycle time) but within 500 ms.
#[test]
fn an_async_op_nobody_waits_for_runs_after_the_grace() {
    for (cycle, at_least, at_most) in [
        (
            Duration::from_millis(1),
            Duration::ZERO,
            Duration::from_millis(500),
        ),
        (
            Duration::from_millis(20),
            Duration::from_millis(5),
            Duration::from_millis(500),
        ),
    ] {
        let ranks = job(2, |_| Config::default().cycle_time(cycle));
        let took = on_every_rank(&ranks, |r, k| {
            // Let the engine thread go idle (past its spin after the start).
            std::thread::sleep(Duration::from_millis(50));
            let t = Tensor::from_vec(vec![r as f32 + 1.0], &[1]).unwrap_or_else(|e| panic!("{e}"));
            let start = std::time::Instant::now();
            let h = k
                .allreduce("nobody.waits", t)
                .op(ReduceOp::Sum)
                .submit()
                .unwrap_or_else(|e| panic!("{e}"));
            while !h.poll() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_micros(100));
            }
            let took = start.elapsed();
            assert_eq!(values(h.wait().unwrap_or_else(|e| panic!("{e}"))), [3.0]);
            took
        });
        for (r, t) in took.iter().enumerate() {
            assert!(
                *t >= at_least && *t <= at_most,
                "cycle time {cycle:?}: rank {r}'s op completed after {t:?}"
            );
        }
    }
}
