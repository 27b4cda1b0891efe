//! The engine's GPU executor on the loopback transport's simulated device
//! (`transport/loopback/sim_device.rs`): ops complete later than they are enqueued,
//! as on a real stream, so the failure paths of issue 31 (items 19, 22, 23) run here
//! without a GPU.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{on_every_rank, start};
use crate::config::Config;
use crate::error::Error;
use crate::handle::Handle;
use crate::submit_error::SubmitError;
use crate::tensor::{Device, Tensor};
use crate::transport::loopback::sim_device::SimDevices;
use crate::transport::loopback::{Loopback, Watchdog};
use crate::vocab::ReduceOp;

/// The f32 values of a simulated device tensor.
fn device_values(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.device(), Device::Cuda(0), "a device tensor");
    bytemuck::pod_collect_to_vec(t.host_bytes())
}

/// Polls `h` until it completes or `limit` passes (then None: it is still pending).
fn wait_within<T>(h: Handle<T>, limit: Duration) -> Option<Result<T, SubmitError>> {
    let deadline = Instant::now() + limit;
    while !h.poll() {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Some(h.wait_or_return())
}

/// Waits (bounded) until `cond` holds.
fn eventually(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `size` ranks with their simulated devices.
fn device_job(size: usize) -> (Vec<crate::runtime::Kolo>, Arc<SimDevices>) {
    let ends = Loopback::job(size);
    let devices = ends[0].devices();
    (start(ends, |_| Config::default()), devices)
}

#[test]
fn simulated_device_ops_give_the_host_results() {
    let (ranks, devices) = device_job(2);
    let out = on_every_rank(&ranks, |r, k| {
        let x = r as f32 + 1.0;
        let sum = k
            .allreduce("sum", devices.tensor(&[x, 2.0 * x], 0))
            .op(ReduceOp::Sum)
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let avg = k
            .allreduce("avg", devices.tensor(&[x], 0))
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let all = k
            .allgather("gather", devices.tensor(&[x; 2], 0))
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let b = k
            .broadcast("bcast", devices.tensor(&[x * 10.0], 0), 1)
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let base = 10.0 * r as f32;
        let a2a = k
            .alltoall("a2a", devices.tensor(&[base, base + 1.0, base + 2.0], 0))
            .splits(vec![1, 2])
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let scattered = k
            .reducescatter("rs", devices.tensor(&[x, x + 1.0, x + 2.0, x + 3.0], 0))
            .op(ReduceOp::Sum)
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let values = [sum, avg, all, b, a2a.tensor, scattered].map(|t| device_values(&t));
        (values, a2a.received_splits)
    });
    for (r, ([sum, avg, all, b, a2a, scattered], splits)) in out.into_iter().enumerate() {
        assert_eq!(sum, [3.0, 6.0]);
        assert_eq!(avg, [1.5]);
        assert_eq!(all, [1.0, 1.0, 2.0, 2.0]);
        assert_eq!(b, [20.0]);
        // Rank 0 gets row 0 of each rank, rank 1 rows 1 and 2 of each.
        let (want, want_splits) = if r == 0 {
            (vec![0.0, 10.0], vec![1, 1])
        } else {
            (vec![1.0, 2.0, 11.0, 12.0], vec![2, 2])
        };
        assert_eq!((a2a, splits), (want, want_splits), "rank {r}'s alltoall");
        // The sum [3, 5, 7, 9], half each.
        let want = if r == 0 { [3.0, 5.0] } else { [7.0, 9.0] };
        assert_eq!(scattered, want, "rank {r}'s reducescatter");
    }
    for k in ranks {
        k.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(devices.violations(), Vec::<String>::new());
    // Issue 34: blocking waits on device ops leave the device to the engine threads
    // (callers drive only host work).
    assert_eq!(devices.enqueuing_threads(), ["kolo-engine"]);
}

/// Issue 31, item 19: an op enqueued on the device when another rank leaves still
/// completes once the device has run it (it did: every rank enqueued it), instead
/// of staying pending until this rank shuts down.
#[test]
fn issue31_a_gpu_op_in_flight_when_a_rank_leaves_completes() {
    let (mut ranks, devices) = device_job(2);
    devices.hold(true);
    let handles = on_every_rank(&ranks, |r, k| {
        k.allreduce("g", devices.tensor(&[r as f32 + 1.0, 2.0], 0))
            .op(ReduceOp::Sum)
            .submit()
            .unwrap_or_else(|e| panic!("{e}"))
    });
    eventually("both ranks enqueueing", Duration::from_secs(10), || {
        devices.enqueued(0) == 2
    });
    let _watchdog = Watchdog::new("a rank leaving with a GPU op in flight");
    let leaver = ranks.pop().unwrap_or_else(|| panic!("rank 1"));
    let left = std::thread::spawn(move || leaver.shutdown());
    // Rank 0 learns that rank 1 left: a host op fails naming it.
    let probe = Tensor::from_vec(vec![1.0f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
    match ranks[0].allreduce("probe", probe).wait() {
        Err(Error::RankLeft { rank: 1, .. }) => {}
        other => panic!("expected rank 1 to have left, got {other:?}"),
    }
    devices.hold(false);
    let mut handles = handles.into_iter();
    let mine = handles.next().unwrap_or_else(|| panic!("rank 0's handle"));
    let result = wait_within(mine, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("rank 0's GPU op stayed pending after the device ran it"));
    let t = result.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(device_values(&t), [3.0, 4.0]);
    left.join()
        .unwrap_or_else(|_| panic!("rank 1's shutdown panicked"))
        .unwrap_or_else(|e| panic!("{e}"));
    drop(handles);
    ranks[0].shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(devices.violations(), Vec::<String>::new());
}

/// Issue 31, item 22: while an op waits on the device (behind the user's kernels, or
/// a slow peer), the engine keeps its heartbeat cycles, so the other ranks and the
/// watchdog see it alive.
#[test]
fn issue31_heartbeats_go_on_while_a_gpu_op_waits() {
    let ends = Loopback::job(2);
    let devices = ends[0].devices();
    let exchanges = ends[0].exchanges();
    let ranks = start(ends, |_| Config::default());
    // Before the fix the engines never cycled again and the shutdown below hung.
    let _watchdog = Watchdog::new("cycles while a GPU op waits");
    devices.hold(true);
    let handles = on_every_rank(&ranks, |_, k| {
        k.allreduce("slow", devices.tensor(&[1.0], 0))
            .op(ReduceOp::Sum)
            .submit()
            .unwrap_or_else(|e| panic!("{e}"))
    });
    eventually("both ranks enqueueing", Duration::from_secs(10), || {
        devices.enqueued(0) == 2
    });
    let before = exchanges.load(Ordering::Relaxed);
    // Heartbeats come every 100 ms; three of them within 10 s on any machine.
    eventually(
        "three heartbeat cycles while the op waits on the device",
        Duration::from_secs(10),
        || exchanges.load(Ordering::Relaxed) >= before + 3,
    );
    devices.hold(false);
    for h in handles {
        let t = h.wait().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(device_values(&t), [2.0]);
    }
    for k in ranks {
        k.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(devices.violations(), Vec::<String>::new());
}

/// Issue 31, item 23: an op that fails after part of it was enqueued (here the
/// second member of a group) keeps every buffer until the device has settled.
#[test]
fn issue31_a_failed_gpu_op_keeps_its_buffers_until_the_device_settled() {
    let (ranks, devices) = device_job(1);
    devices.hold(true);
    devices.fail_enqueue(0, 1);
    let k = &ranks[0];
    let group = vec![
        ("a".to_string(), devices.tensor(&[1.0, 2.0], 0)),
        ("b".to_string(), devices.tensor(&[3.0], 0)),
    ];
    let _watchdog = Watchdog::new("a failed GPU group");
    match k.grouped_allreduce(group).op(ReduceOp::Sum).wait() {
        Err(e) => assert!(
            e.to_string().contains("simulated enqueue failure"),
            "the enqueue's error: {e}"
        ),
        Ok(_) => panic!("the group should fail"),
    }
    assert_eq!(
        devices.violations(),
        Vec::<String>::new(),
        "no buffer freed while the device could still use it"
    );
    devices.hold(false);
    k.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// Issue 31, item 20: a rank that cannot run an op (here: allocating its output
/// fails) fails it on every rank, naming that rank, before anything is enqueued;
/// the other ranks' tensors come back, and later ops run.
#[test]
fn issue31_a_rank_local_failure_before_the_enqueue_fails_the_op_everywhere() {
    let (ranks, devices) = device_job(2);
    devices.fail_alloc_on(Some(1));
    let _watchdog = Watchdog::new("a rank-local GPU failure");
    let handles = on_every_rank(&ranks, |r, k| {
        k.allgather("g", devices.tensor(&[r as f32], 0))
            .submit()
            .unwrap_or_else(|e| panic!("{e}"))
    });
    let mut outcomes = handles
        .into_iter()
        .map(|h| wait_within(h, Duration::from_secs(10)));
    match outcomes.next().flatten() {
        Some(Err(e)) if matches!(e.error(), Error::PeerFailed { rank: 1, .. }) => {
            let message = e.to_string();
            let tensors = e.into_tensors();
            assert!(message.contains("simulated out of memory"), "{message}");
            assert_eq!(tensors.len(), 1, "rank 0's tensor handed back");
            assert_eq!(device_values(&tensors[0]), [0.0]);
        }
        Some(other) => panic!("rank 0: expected rank 1 named, got {other:?}"),
        None => panic!("rank 0's allgather stayed pending: rank 1 never enqueued it"),
    }
    match outcomes.next().flatten() {
        Some(Err(e)) => assert!(e.to_string().contains("simulated out of memory"), "{e}"),
        other => panic!("rank 1: expected its allocation error, got {other:?}"),
    }
    devices.fail_alloc_on(None);
    let again = on_every_rank(&ranks, |r, k| {
        k.allgather("g", devices.tensor(&[r as f32], 0))
            .wait()
            .unwrap_or_else(|e| panic!("{e}"))
    });
    for t in again {
        assert_eq!(device_values(&t), [0.0, 1.0]);
    }
    for k in ranks {
        k.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(devices.violations(), Vec::<String>::new());
}

/// Issue 31, item 21: the job's engine and a process set's engine each have a device
/// communicator on a rank's one device. Here the first member's job enqueues and the
/// second member's set enqueues are slowed, so that without an agreed order the first
/// would enqueue the set's op before the job's and the second the job's before the
/// set's — an order a real device can deadlock on. With the set's device cycles
/// taking turns from the job's engine, every rank enqueues both communicators' ops in
/// one order.
fn device_ops_of_job_and_set_in_one_order(size: usize, members: &[usize]) {
    let (ranks, devices) = device_job(size);
    let sets = on_every_rank(&ranks, |_, k| {
        k.add_process_set(members).unwrap_or_else(|e| panic!("{e}"))
    });
    devices.delay_enqueues(members[0], 0, Duration::from_millis(60));
    devices.delay_enqueues(members[1], 1, Duration::from_millis(60));
    let rounds = 3;
    let job_sum = (1..=size).sum::<usize>() as f32;
    let set_sum = members.iter().map(|&m| 10.0 * (m + 1) as f32).sum::<f32>();
    on_every_rank(&ranks, |r, k| {
        let set = &sets[r];
        let x = r as f32 + 1.0;
        std::thread::scope(|s| {
            let job = s.spawn(|| {
                for i in 0..rounds {
                    let out = k
                        .allreduce(format!("job.{i}"), devices.tensor(&[x], 0))
                        .op(ReduceOp::Sum)
                        .wait()
                        .unwrap_or_else(|e| panic!("job op {i}: {e}"));
                    assert_eq!(device_values(&out), [job_sum], "job op {i}");
                }
            });
            for i in 0..rounds {
                if !set.includes(r) {
                    break;
                }
                let out = k
                    .allreduce(format!("set.{i}"), devices.tensor(&[10.0 * x], 0))
                    .op(ReduceOp::Sum)
                    .process_set(set)
                    .wait()
                    .unwrap_or_else(|e| panic!("set op {i}: {e}"));
                assert_eq!(device_values(&out), [set_sum], "set op {i}");
            }
            job.join()
                .unwrap_or_else(|_| panic!("the job's ops panicked"));
        });
    });
    assert_eq!(devices.order_conflicts(), Vec::<String>::new());
    assert_eq!(devices.violations(), Vec::<String>::new());
    let threads = devices.enqueuing_threads();
    assert!(
        threads.iter().all(|t| t.starts_with("kolo-engine")),
        "device ops enqueued on {threads:?}"
    );
}

#[test]
fn job_and_process_set_device_ops_enqueue_in_one_order_on_every_rank() {
    device_ops_of_job_and_set_in_one_order(2, &[0, 1]);
}

/// The same with a rank outside the set, whose job engine negotiates the set's turns
/// without taking part in them.
#[test]
fn device_turns_of_a_set_pass_ranks_outside_it() {
    device_ops_of_job_and_set_in_one_order(3, &[1, 2]);
}
