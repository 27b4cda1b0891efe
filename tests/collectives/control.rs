//! Join, barrier, objects, ordering, topology, submit-time errors and shutdown.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};
use serde::{Deserialize, Serialize};

use crate::util::*;

/// Rank, size and the node split agree with the launcher.
pub(crate) fn topology(k: &Kolo) -> Result<()> {
    let np: usize = std::env::var("OMPI_COMM_WORLD_SIZE")?.parse()?;
    let me: usize = std::env::var("OMPI_COMM_WORLD_RANK")?.parse()?;
    ensure!(
        k.size() == np && k.rank() == me,
        "rank {} size {}",
        k.rank(),
        k.size()
    );
    // The node split: local ranks are the ranks on this host (as mpirun numbers
    // them); cross ranks number the ranks with the same local rank across hosts.
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK")?.parse()?;
    let local_size: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")?.parse()?;
    ensure!(
        k.local_size() == local_size && k.local_rank() == local,
        "local {} of {}, mpirun says {local} of {local_size}",
        k.local_rank(),
        k.local_size()
    );
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    let all: Vec<(String, usize)> = k.allgather_object("topology.hosts", (host.clone(), local))?;
    let peers: Vec<usize> = (0..np).filter(|&r| all[r].1 == local).collect();
    let cross_rank = peers.iter().position(|&r| r == me).unwrap_or(usize::MAX);
    ensure!(
        k.cross_size() == peers.len() && k.cross_rank() == cross_rank,
        "cross {} of {}, expected {cross_rank} of {}",
        k.cross_rank(),
        k.cross_size(),
        peers.len()
    );
    // The ranks of one host are those whose hostname is ours.
    let same_host = all.iter().filter(|(h, _)| *h == host).count();
    ensure!(
        same_host == local_size,
        "{same_host} ranks on {host}, local size {local_size}"
    );
    // A second init in the same process is refused.
    expect_err("second init", kolo::init(), &["already initialised"])?;
    Ok(())
}

/// For every first-joining rank: the others' average is t·(size-1)/size, allgather
/// while a rank is joined fails, and join returns the same last rank everywhere.
pub(crate) fn join(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for first in 0..size {
        let last = if rank == first {
            k.join()?
        } else {
            let t = Tensor::from_vec(vec![3.0f32; 10], &[10])?;
            let avg: Vec<f32> = k
                .allreduce(format!("join.avg.{first}"), t)
                .wait()?
                .into_vec()?;
            let want = 3.0 * (size - 1) as f32 / size as f32;
            ensure!(
                avg.iter().all(|&x| (x - want).abs() < 1e-6),
                "join avg {:?}, want {want}",
                &avg[..2]
            );
            let t = Tensor::from_vec(vec![1i32; 4], &[4])?;
            let sum: Vec<i32> = k
                .allreduce(format!("join.sum.{first}"), t)
                .op(ReduceOp::Sum)
                .wait()?
                .into_vec()?;
            ensure!(sum == vec![(size - 1) as i32; 4], "join sum {sum:?}");
            expect_err(
                "allgather while joined",
                k.allgather(format!("join.ag.{first}"), Tensor::zeros(DType::F32, &[2]))
                    .wait(),
                &["cannot run while rank(s)", &format!("[{first}]")],
            )?;
            k.join()?
        };
        let all = k.allgather_object(format!("join.last.{first}"), last)?;
        ensure!(
            all.iter().all(|&l| l == all[0]) && all[0] < size,
            "join returned {all:?}"
        );
        if size > 1 {
            ensure!(
                all[0] != first || size == 1,
                "the first rank to join ({first}) was reported last"
            );
        }
    }
    Ok(())
}

/// Every rank's barrier lasts at least as long as rank 0's sleep before it; a
/// barrier with async ops still pending does not deadlock.
pub(crate) fn barrier(k: &Kolo) -> Result<()> {
    let sleep = Duration::from_millis(1500);
    // Line the ranks up first: processes start at different times. Ranks leave a
    // barrier within a few milliseconds of each other, hence the 100 ms of slack.
    k.barrier()?;
    let start = Instant::now();
    if k.rank() == 0 {
        std::thread::sleep(sleep);
    }
    k.barrier()?;
    ensure!(
        start.elapsed() >= sleep - Duration::from_millis(100),
        "barrier returned after {:?}, before rank 0 arrived",
        start.elapsed()
    );

    let h = k
        .allreduce("barrier.pending", Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .submit()?;
    k.barrier()?;
    ensure!(
        h.wait()?.into_vec::<f32>()? == [k.size() as f32],
        "pending op across a barrier"
    );
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Settings {
    lr: f64,
    name: String,
    layers: Vec<u32>,
}

/// Refuses to serialise on rank 1 only.
struct Fragile(usize);

impl Serialize for Fragile {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == 1 {
            Err(serde::ser::Error::custom("rank 1 cannot serialise this"))
        } else {
            s.serialize_u64(self.0 as u64)
        }
    }
}

impl<'de> Deserialize<'de> for Fragile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Fragile(u64::deserialize(d)? as usize))
    }
}

/// broadcast_object from every root and allgather_object; a rank whose object does not
/// serialise is named on every rank.
pub(crate) fn objects(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for root in 0..size {
        let mine = Settings {
            lr: 0.1 * rank as f64,
            name: format!("from {rank}"),
            layers: vec![rank as u32; rank + 1],
        };
        let got: Settings = k.broadcast_object(format!("obj.{root}"), mine, root)?;
        ensure!(
            got.name == format!("from {root}") && got.layers.len() == root + 1,
            "broadcast_object from {root}: {got:?}"
        );
    }
    let all: Vec<(usize, String)> = k.allgather_object("obj.all", (rank, "x".repeat(rank)))?;
    ensure!(all.len() == size, "allgather_object length");
    for (r, (got_r, s)) in all.iter().enumerate() {
        ensure!(
            *got_r == r && s.len() == r,
            "allgather_object entry {r}: {got_r} {s:?}"
        );
    }
    if size > 1 {
        expect_err(
            "fragile",
            k.allgather_object("obj.fragile", Fragile(rank))
                .map(|v| v.len()),
            &["allgather_object", "from rank 1"],
        )?;
        let r = k
            .broadcast_object("obj.fragile.bc", Fragile(rank), 1)
            .map(|f| f.0);
        expect_err("fragile bc", r, &["broadcast_object", "from rank 1"])?;
    }
    Ok(())
}

/// 50 tensors submitted from two threads per rank, in a different order on each rank:
/// no deadlock, every sum right.
pub(crate) fn order_independence(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let mut ids: Vec<usize> = (0..50).collect();
    Rng::new(rank as u64 + 17).shuffle(&mut ids);
    let (a, b) = ids.split_at(25);
    let run = |ids: Vec<usize>, k: Kolo| -> Result<()> {
        let handles = ids
            .iter()
            .map(|&i| {
                let t = Tensor::from_vec(vec![i as f64; i + 1], &[i + 1])?;
                Ok((
                    i,
                    k.allreduce(format!("order.{i}"), t)
                        .op(ReduceOp::Sum)
                        .submit()?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        for (i, h) in handles {
            let v: Vec<f64> = h.wait()?.into_vec()?;
            ensure!(v == vec![(i * size) as f64; i + 1], "order.{i}");
        }
        Ok(())
    };
    let (a, b) = (a.to_vec(), b.to_vec());
    let (k1, k2) = (k.clone(), k.clone());
    std::thread::scope(|s| {
        let t1 = s.spawn(move || run(a, k1));
        let t2 = s.spawn(move || run(b, k2));
        t1.join()
            .map_err(|_| anyhow::anyhow!("thread 1 panicked"))??;
        t2.join()
            .map_err(|_| anyhow::anyhow!("thread 2 panicked"))??;
        Ok(())
    })
}

/// Submit-time errors are immediate and local, and leave the engine working; after
/// shutdown a submit hands the tensor back.
pub(crate) fn submit_errors(k: &Kolo) -> Result<()> {
    // A refused submit hands its tensors back inside the error.
    let handed_back = |what: &str, e: kolo::SubmitError, want: &[i32]| -> Result<()> {
        let back = e.into_tensors();
        ensure!(
            back.len() == 1 && back[0].as_slice::<i32>()? == want,
            "{what}: the tensor was not handed back ({} tensors)",
            back.len()
        );
        Ok(())
    };
    match k
        .allreduce("", Tensor::from_vec(vec![7i32, 8], &[2])?)
        .submit()
    {
        Ok(_) => anyhow::bail!("empty name accepted"),
        Err(e) => {
            ensure!(e.to_string().contains("names must not be empty"), "{e}");
            handed_back("empty name", e, &[7, 8])?;
        }
    }
    // Rank 0's first "dup" stays pending until the others submit theirs, after the
    // barrier: its second "dup" is refused meanwhile.
    if k.rank() == 0 {
        let first = k
            .allreduce("dup", Tensor::from_vec(vec![1i32], &[1])?)
            .submit()?;
        if k.size() > 1 {
            match k
                .allreduce("dup", Tensor::from_vec(vec![9i32, 9, 9], &[3])?)
                .submit()
            {
                Ok(_) => anyhow::bail!("a duplicate pending name was accepted"),
                Err(e) => {
                    ensure!(
                        matches!(e.error(), kolo::Error::DuplicateName { .. }),
                        "duplicate name: {e}"
                    );
                    handed_back("duplicate name", e, &[9, 9, 9])?;
                }
            }
        }
        k.barrier()?;
        first.wait()?;
    } else {
        k.barrier()?;
        k.allreduce("dup", Tensor::from_vec(vec![1i32], &[1])?)
            .wait()?;
    }
    expect_err(
        "nan scale",
        k.allreduce("nan", Tensor::zeros(DType::F32, &[1]))
            .prescale(f64::NAN)
            .submit(),
        &["prescale factor NaN"],
    )?;
    let v = k
        .allreduce("after.submit.errors", Tensor::from_vec(vec![2u8], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?;
    ensure!(
        v.into_vec::<u8>()? == [2 * k.size() as u8],
        "engine after submit errors"
    );
    k.shutdown()?;
    let err = k
        .allreduce("late", Tensor::from_vec(vec![5i32; 3], &[3])?)
        .submit();
    let e = match err {
        Ok(_) => anyhow::bail!("submit after shutdown succeeded"),
        Err(e) => e,
    };
    ensure!(e.to_string().contains("has been shut down"), "{e}");
    let back = e.into_tensors();
    ensure!(
        back.len() == 1 && back[0].as_slice::<i32>()? == [5, 5, 5],
        "tensor not handed back"
    );
    Ok(())
}

/// kolo's own keys live apart from user names: tensors named "join" and "barrier"
/// are in flight together with a join and a barrier, two groups whose names differ
/// only in where ", " falls are in flight together, and a name in the reserved space
/// ("@…") is refused at submit.
pub(crate) fn key_spaces(k: &Kolo) -> Result<()> {
    let size = k.size() as i32;
    let one = |v: i32| Tensor::from_vec(vec![v], &[1]);
    let join_t = k.allreduce("join", one(1)?).op(ReduceOp::Sum).submit()?;
    let barrier_t = k.allreduce("barrier", one(2)?).op(ReduceOp::Sum).submit()?;
    k.barrier()?;
    ensure!(
        join_t.wait()?.into_vec::<i32>()? == [size],
        "tensor \"join\""
    );
    ensure!(
        barrier_t.wait()?.into_vec::<i32>()? == [2 * size],
        "tensor \"barrier\""
    );
    // One group of one tensor named "a, b"; one of two tensors "a" and "b".
    let g1 = k
        .grouped_allreduce(vec![("a, b".into(), one(10)?)])
        .op(ReduceOp::Sum)
        .submit()?;
    let g2 = k
        .grouped_allreduce(vec![("a".into(), one(20)?), ("b".into(), one(30)?)])
        .op(ReduceOp::Sum)
        .submit()?;
    let r1: Vec<Vec<i32>> = g1
        .wait()?
        .into_iter()
        .map(|t| t.into_vec::<i32>())
        .collect::<std::result::Result<_, _>>()?;
    let r2: Vec<Vec<i32>> = g2
        .wait()?
        .into_iter()
        .map(|t| t.into_vec::<i32>())
        .collect::<std::result::Result<_, _>>()?;
    ensure!(r1 == [vec![10 * size]], "group [\"a, b\"]: {r1:?}");
    ensure!(
        r2 == [vec![20 * size], vec![30 * size]],
        "group [\"a\", \"b\"]: {r2:?}"
    );
    expect_err(
        "reserved name",
        k.allreduce("@join", one(1)?).submit(),
        &["names starting with '@' are reserved"],
    )?;
    let last = k.join()?;
    ensure!(last < k.size(), "join returned {last}");
    Ok(())
}

/// The last rank shuts down early: the others' next op fails naming it, quickly.
pub(crate) fn rank_leaves(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    if size == 1 {
        return Ok(());
    }
    k.allreduce("leave.before", Tensor::zeros(DType::F32, &[2]))
        .wait()?;
    if rank == size - 1 {
        // Bounded, and well within the bound: the others shut down a moment later.
        k.shutdown_timeout(Duration::from_secs(30))?;
        return Ok(());
    }
    let start = Instant::now();
    let leaver = format!("rank {} has shut down", size - 1);
    expect_err(
        "pending",
        k.allreduce("leave.pending", Tensor::zeros(DType::F32, &[2]))
            .wait(),
        &[&leaver],
    )?;
    expect_err(
        "later",
        k.allgather("leave.later", Tensor::zeros(DType::F32, &[2]))
            .wait(),
        &[&leaver],
    )?;
    ensure!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?} to notice",
        start.elapsed()
    );
    // The timeline is local: it still starts, records the failing ops and stops.
    let path = std::env::temp_dir().join(format!(
        "kolo-timeline-after-leave-{}-{rank}.json",
        std::process::id()
    ));
    k.start_timeline(&path)?;
    let _ = k
        .allreduce("leave.traced", Tensor::zeros(DType::F32, &[2]))
        .wait();
    k.stop_timeline()?;
    let text = std::fs::read_to_string(&path)?;
    std::fs::remove_file(&path)?;
    ensure!(
        text.trim_start().starts_with('[') && text.trim_end().ends_with(']'),
        "the timeline written after the rank left is not a complete trace: {text:?}"
    );
    Ok(())
}
