use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Executor, Pending};
use crate::config::MAX_FUSED_TENSOR_BYTES as MAX;
use crate::engine::negotiate::{Ready, Response};
use crate::engine::queue::Queue;
use crate::engine::request::{OpKind, Request, RequestMeta, TensorMeta};
use crate::error::Error;
use crate::handle::{self, Handle, PendingNames};
use crate::tensor::{DType, Tensor};
use crate::transport::loopback::on_loopback_ranks;
use crate::transport::loopback::Loopback;
use crate::vocab::ReduceOp;

fn meta(key: &str, kind: OpKind, len: usize) -> RequestMeta {
    RequestMeta::for_test(key, kind, DType::F32, &[len], ReduceOp::Sum)
}

/// A response every rank submitted, except those in `joined`.
fn ready(meta: &RequestMeta, size: usize, joined: &[usize]) -> Response {
    let shared = Arc::new(meta.clone());
    Response::Run(Ready {
        key: meta.key.clone(),
        kind: meta.kind,
        metas: (0..size)
            .map(|r| (!joined.contains(&r)).then(|| shared.clone()))
            .collect(),
    })
}

/// Puts this rank's request for `meta` with `values` among the pending ones.
fn submit(pending: &mut Pending, meta: &RequestMeta, values: &[f32]) -> Handle<Tensor> {
    let tensor = Tensor::from_vec(values.to_vec(), &[values.len()]).unwrap();
    let (h, req) = Request::with_handle(meta.clone(), tensor, Arc::new(Queue::default()), 0);
    pending.insert(meta.key.clone(), Box::new(req));
    h
}

fn values(h: Handle<Tensor>) -> Vec<f32> {
    h.wait().unwrap().into_vec::<f32>().unwrap()
}

#[test]
fn fused_and_single_responses_give_the_same_sums_and_complete_every_handle() {
    let (a, b, c) = (
        meta("a", OpKind::Allreduce, 3),
        meta("b", OpKind::Allreduce, 2),
        meta("c", OpKind::Allgather, 2),
    );
    for threshold in [0, 1 << 20] {
        let out = on_loopback_ranks(2, |rank, mut t| {
            let t = &mut t;
            let mut exec = Executor::new(rank, false, Duration::ZERO);
            let mut pending = Pending::default();
            let x = rank as f32;
            let ha = submit(&mut pending, &a, &[1.0 + x, 2.0, 3.0]);
            let hb = submit(&mut pending, &b, &[10.0 * x, 5.0]);
            let hc = submit(&mut pending, &c, &[x, x]);
            let responses = vec![ready(&a, 2, &[]), ready(&c, 2, &[]), ready(&b, 2, &[])];
            exec.run(t, &mut pending, responses, Instant::now(), threshold, MAX);
            assert!(pending.is_empty(), "every response takes its request");
            let buffered = exec.fusion_buffer.capacity();
            (values(ha), values(hb), values(hc), buffered)
        });
        for (ra, rb, rc, buffered) in out {
            assert_eq!(ra, [3.0, 4.0, 6.0], "threshold {threshold}");
            assert_eq!(rb, [10.0, 10.0], "threshold {threshold}");
            assert_eq!(rc, [0.0, 0.0, 1.0, 1.0], "threshold {threshold}");
            // Fused: a and b (20 bytes) through the buffer; alone: in place.
            let want = if threshold > 0 { 24 } else { 0 };
            assert_eq!(buffered, want, "threshold {threshold}");
        }
    }
}

#[test]
fn large_sums_go_to_the_transport_as_one_group_in_their_own_buffers() {
    let n = MAX / 4 + 1;
    let big = |key| RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, &[n], ReduceOp::Sum);
    let (a, b, c) = (big("a"), big("b"), big("c"));
    for group in [0, 64 << 20] {
        let out = on_loopback_ranks(2, |rank, t| {
            let mut t = t.with_in_place_groups(group);
            let mut exec = Executor::new(rank, false, Duration::ZERO);
            let mut pending = Pending::default();
            let x = rank as f32 + 1.0;
            let ha = submit(&mut pending, &a, &vec![x; n]);
            let hb = submit(&mut pending, &b, &vec![10.0 * x; n]);
            // Rank 1 has joined for c: it contributes zeros.
            let hc = (rank == 0).then(|| submit(&mut pending, &c, &vec![7.0; n]));
            let responses = vec![ready(&a, 2, &[]), ready(&b, 2, &[]), ready(&c, 2, &[1])];
            exec.run(
                &mut t,
                &mut pending,
                responses,
                Instant::now(),
                1 << 20,
                MAX,
            );
            let calls = t.calls();
            let buffered = exec.fusion_buffer.capacity();
            (values(ha), values(hb), hc.map(values), calls, buffered)
        });
        for (rank, (ra, rb, rc, calls, buffered)) in out.into_iter().enumerate() {
            assert_eq!(ra, vec![3.0; n], "group {group}");
            assert_eq!(rb, vec![30.0; n], "group {group}");
            assert_eq!(rc, (rank == 0).then(|| vec![7.0; n]), "group {group}");
            // One call for the group, one per tensor without; never the buffer.
            assert_eq!(calls, if group > 0 { 1 } else { 3 }, "group {group}");
            assert_eq!(buffered, 0, "group {group}");
        }
    }
}

/// Issue 33: one fusion policy. A group's members too large to fuse go to the
/// transport in batches, as separate allreduces of that size do; the small ones
/// through the fusion buffer.
#[test]
fn a_groups_large_members_go_to_the_transport_together() {
    let n = MAX / 4 + 1;
    let names = ["a", "b", "c", "s1", "s2"];
    let lens = [n, n, n, 3, 2];
    let mut meta = RequestMeta::for_test(
        "g",
        OpKind::GroupedAllreduce,
        DType::F32,
        &[n],
        ReduceOp::Sum,
    );
    meta.tensors = names
        .iter()
        .zip(lens)
        .map(|(name, len)| TensorMeta {
            name: (*name).into(),
            dtype: DType::F32,
            shape: [len].as_slice().into(),
        })
        .collect();
    for group in [0, 64 << 20] {
        let out = on_loopback_ranks(2, |rank, t| {
            let mut t = t.with_in_place_groups(group);
            let mut exec = Executor::new(rank, false, Duration::ZERO);
            let mut pending = Pending::default();
            let x = rank as f32 + 1.0;
            let queue: Arc<dyn PendingNames> = Arc::new(Queue::default());
            let (h, done) = handle::pair(
                smallvec::smallvec![meta.key.clone()],
                queue,
                (meta.kind.name(), 0),
                handle::to_tensors,
            );
            let tensors = lens
                .iter()
                .enumerate()
                .map(|(i, &len)| Tensor::from_vec(vec![x * (i + 1) as f32; len], &[len]).unwrap())
                .collect();
            let req = Request {
                meta: meta.clone(),
                tensors,
                done,
                submitted: Instant::now(),
            };
            pending.insert(meta.key.clone(), Box::new(req));
            exec.run(
                &mut t,
                &mut pending,
                vec![ready(&meta, 2, &[])],
                Instant::now(),
                1 << 20,
                MAX,
            );
            let sums: Vec<Vec<f32>> = h
                .wait()
                .unwrap()
                .into_iter()
                .map(|t| t.into_vec::<f32>().unwrap())
                .collect();
            (sums, t.calls())
        });
        for (sums, calls) in out {
            for (i, (sum, len)) in sums.iter().zip(lens).enumerate() {
                assert_eq!(
                    sum,
                    &vec![3.0 * (i + 1) as f32; len],
                    "member {i}, group {group}"
                );
            }
            // The small two through the buffer (one call); the large three in one
            // call where the transport takes groups, one call each where not.
            assert_eq!(calls, if group > 0 { 2 } else { 4 }, "group {group}");
        }
    }
}

#[test]
fn a_joined_rank_contributes_zeros_to_a_fused_batch() {
    let (a, b) = (
        meta("a", OpKind::Allreduce, 2),
        meta("b", OpKind::Allreduce, 1),
    );
    let out = on_loopback_ranks(2, |rank, mut t| {
        let t = &mut t;
        let mut exec = Executor::new(rank, false, Duration::ZERO);
        let mut pending = Pending::default();
        let ha = submit(&mut pending, &a, &[1.0, 2.0]);
        // Rank 1 has joined for b: it has no request, the response says so.
        let hb = (rank == 0).then(|| submit(&mut pending, &b, &[7.0]));
        let responses = vec![ready(&a, 2, &[]), ready(&b, 2, &[1])];
        exec.run(t, &mut pending, responses, Instant::now(), 1 << 20, MAX);
        (values(ha), hb.map(values))
    });
    assert_eq!(out[0], (vec![2.0, 4.0], Some(vec![7.0])));
    assert_eq!(out[1], (vec![2.0, 4.0], None));
}

#[test]
fn a_failed_fused_batch_gives_every_member_the_error_with_its_kind() {
    let mut ends = Loopback::job(2);
    drop(ends.pop());
    let t = &mut ends[0];
    let (a, b) = (
        meta("a", OpKind::Allreduce, 2),
        meta("b", OpKind::Allreduce, 2),
    );
    let mut exec = Executor::new(0, false, Duration::ZERO);
    let mut pending = Pending::default();
    let ha = submit(&mut pending, &a, &[1.0, 2.0]);
    let hb = submit(&mut pending, &b, &[3.0, 4.0]);
    exec.run(
        t,
        &mut pending,
        vec![ready(&a, 2, &[]), ready(&b, 2, &[])],
        Instant::now(),
        1 << 20,
        MAX,
    );
    for h in [ha, hb] {
        match h.wait() {
            Err(Error::Transport { message, .. }) => {
                assert!(message.contains("rank 1 left"), "{message}")
            }
            other => panic!("expected the transport's error, got {other:?}"),
        }
    }
}

#[test]
fn the_timeline_shows_negotiation_and_the_fused_phases_of_each_member() {
    let path = std::env::temp_dir().join(format!("kolo-executor-unit-{}.json", std::process::id()));
    let mut ends = Loopback::job(1);
    let t = &mut ends[0];
    let (a, b) = (
        meta("a", OpKind::Allreduce, 2),
        meta("b", OpKind::Allreduce, 2),
    );
    let mut exec = Executor::new(0, false, Duration::ZERO);
    exec.timeline.start(&path).unwrap();
    let mut pending = Pending::default();
    let ha = submit(&mut pending, &a, &[1.0, 2.0]);
    let hb = submit(&mut pending, &b, &[3.0, 4.0]);
    exec.run(
        t,
        &mut pending,
        vec![ready(&a, 1, &[]), ready(&b, 1, &[])],
        Instant::now(),
        1 << 20,
        MAX,
    );
    assert_eq!(values(ha), [1.0, 2.0]);
    assert_eq!(values(hb), [3.0, 4.0]);
    exec.timeline.stop();
    let events: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let phases: Vec<&str> = events.iter().filter_map(|e| e["name"].as_str()).collect();
    for phase in [
        "NEGOTIATE",
        "MEMCPY_IN_FUSION_BUFFER",
        "ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
    ] {
        let n = phases.iter().filter(|&&p| p == phase).count();
        assert_eq!(n, 2, "{phase} once per member: {phases:?}");
    }
}
