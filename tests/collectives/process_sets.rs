//! Process sets: collectives among a subset of ranks, each set on its own.

use anyhow::{ensure, Context, Result};
use kolo::{Kolo, ReduceOp, Tensor};

fn f32s(v: Vec<f32>) -> Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, &[n])?)
}

/// The even ranks as a set: every collective among them only, Average over the set's
/// size, a rank outside refused by name, the same name in flight in the job and in
/// the set at once, and a set's errors on its own ranks only.
pub(crate) fn collectives(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let evens: Vec<usize> = (0..size).step_by(2).collect();
    // Any order: the set is the same.
    let mut asked = evens.clone();
    asked.reverse();
    let set = k.add_process_set(&asked)?;
    ensure!(set.ranks() == evens.as_slice(), "ranks {:?}", set.ranks());
    ensure!(set.size() == evens.len());
    ensure!(set.includes(rank) == (rank % 2 == 0));
    ensure!(
        set.rank() == (rank % 2 == 0).then_some(rank / 2),
        "set rank {:?}",
        set.rank()
    );
    ensure!(set.id() == 1, "first set's id {}", set.id());
    let n = evens.len() as f32;
    let member_sum: f32 = evens.iter().map(|&r| r as f32 + 1.0).sum();

    if set.includes(rank) {
        // The same name in the job and in the set, both in flight at once.
        let in_set = k
            .allreduce("x", f32s(vec![rank as f32 + 1.0; 3])?)
            .op(ReduceOp::Sum)
            .process_set(&set)
            .submit()?;
        let in_job = k
            .allreduce("x", f32s(vec![rank as f32 + 1.0; 3])?)
            .op(ReduceOp::Sum)
            .submit()?;
        let s = in_set.wait()?.into_vec::<f32>()?;
        ensure!(s == vec![member_sum; 3], "set sum {s:?}, want {member_sum}");
        let j = in_job.wait()?.into_vec::<f32>()?;
        let all: f32 = (1..=size).map(|r| r as f32).sum();
        ensure!(j == vec![all; 3], "job sum {j:?}");

        let avg = k
            .allreduce("avg", f32s(vec![rank as f32 + 1.0])?)
            .process_set(&set)
            .wait()?
            .into_vec::<f32>()?;
        ensure!(
            (avg[0] - member_sum / n).abs() < 1e-6,
            "average {avg:?} over {n}"
        );

        // Grouped, allgather, broadcast (root a job rank), alltoall, reducescatter.
        let g = k
            .grouped_allreduce(vec![
                ("ga".into(), f32s(vec![1.0])?),
                ("gb".into(), f32s(vec![2.0, 2.0])?),
            ])
            .op(ReduceOp::Sum)
            .process_set(&set)
            .wait()?;
        ensure!(g[0].clone().into_vec::<f32>()? == vec![n]);
        ensure!(g[1].clone().into_vec::<f32>()? == vec![2.0 * n; 2]);
        let ag = k
            .allgather("ag", f32s(vec![rank as f32])?)
            .process_set(&set)
            .wait()?
            .into_vec::<f32>()?;
        let want: Vec<f32> = evens.iter().map(|&r| r as f32).collect();
        ensure!(ag == want, "allgather {ag:?}, want {want:?}");
        let root = *evens.last().context("a set")?;
        let b = k
            .broadcast("b", f32s(vec![rank as f32; 2])?, root)
            .process_set(&set)
            .wait()?
            .into_vec::<f32>()?;
        ensure!(
            b == vec![root as f32; 2],
            "broadcast from job rank {root}: {b:?}"
        );
        let a2a = k
            .alltoall("a2a", f32s(vec![rank as f32; evens.len()])?)
            .process_set(&set)
            .wait()?;
        ensure!(a2a.tensor.into_vec::<f32>()? == want, "alltoall");
        let rs = k
            .reducescatter("rs", f32s(vec![1.0; evens.len()])?)
            .op(ReduceOp::Sum)
            .process_set(&set)
            .wait()?
            .into_vec::<f32>()?;
        ensure!(rs == vec![n], "reducescatter {rs:?}");

        // A root outside the set is refused at submit, naming it.
        if size > 1 {
            let err = k
                .broadcast("bad_root", f32s(vec![0.0])?, 1)
                .process_set(&set)
                .submit()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            ensure!(err.contains("root 1 is not in process set 1"), "{err}");
        }
        // A mismatch inside the set fails on the set's ranks.
        let shape = if rank == 0 { 2 } else { 3 };
        let err = k
            .allreduce("mismatch", f32s(vec![0.0; shape])?)
            .process_set(&set)
            .wait()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        ensure!(
            evens.len() == 1 || err.contains("shape mismatch"),
            "mismatch in a set: {err:?}"
        );
    } else {
        let t = f32s(vec![1.0, 2.0])?;
        let err = k
            .allreduce("x", t)
            .process_set(&set)
            .submit()
            .expect_err("a rank outside the set must be refused");
        let text = err.to_string();
        ensure!(
            text.contains(&format!("rank {rank} is not in process set 1")),
            "{text}"
        );
        // The tensor comes back.
        let back = err.into_tensors();
        ensure!(back.len() == 1 && back[0].len() == 2, "tensor handed back");
        let _ = k
            .allreduce("x", f32s(vec![rank as f32 + 1.0; 3])?)
            .op(ReduceOp::Sum)
            .wait()?;
    }
    optimizer_in_set(k, &set)?;
    k.barrier()?;
    k.remove_process_set(set)?;
    // The job's collectives go on.
    let s = k
        .allreduce("after", f32s(vec![1.0])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(s == vec![size as f32]);
    Ok(())
}

/// Records the gradients each step applies.
#[derive(Default)]
struct Record(Vec<kolo::Gradients>);

impl kolo::GradientStep for Record {
    fn step(
        &mut self,
        g: &kolo::Gradients,
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.push(g.clone());
        Ok(())
    }
}

/// A DistributedOptimizer given the set averages over the set's ranks only; outside
/// the set, build fails naming the rank.
fn optimizer_in_set(k: &Kolo, set: &kolo::ProcessSet) -> Result<()> {
    let rank = k.rank();
    let built = kolo::DistributedOptimizer::builder(k.clone(), Record::default())
        .param("w", &[2], kolo::DType::F32)
        .process_set(set)
        .build();
    if !set.includes(rank) {
        let e = built.err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(
            e.contains(&format!("rank {rank} is not in process set")),
            "{e}"
        );
        return Ok(());
    }
    let mut opt = built?;
    opt.submit_gradient("w", f32s(vec![rank as f32; 2])?)?;
    opt.step()?;
    let mean = set.ranks().iter().sum::<usize>() as f32 / set.size() as f32;
    let got = opt.inner().0[0]
        .get("w")
        .context("gradient w")?
        .as_slice::<f32>()?
        .to_vec();
    ensure!(got == vec![mean; 2], "set average {got:?}, want {mean}");
    Ok(())
}

/// Ranks asking for different sets fail on every rank, naming the ranks and lists;
/// invalid lists fail on every rank too; kolo goes on afterwards.
pub(crate) fn errors(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let text =
        |r: kolo::Result<kolo::ProcessSet>| r.err().map(|e| e.to_string()).unwrap_or_default();
    if size > 1 {
        let mine = if rank == 0 { vec![0] } else { vec![0, 1] };
        let e = text(k.add_process_set(&mine));
        ensure!(
            e.contains("process set mismatch") && e.contains("rank 0 sent ranks [0]"),
            "{e}"
        );
    }
    let e = text(k.add_process_set(&[]));
    ensure!(e.contains("needs at least one rank"), "{e}");
    let e = text(k.add_process_set(&[0, size]));
    ensure!(e.contains(&format!("rank {size} is out of range")), "{e}");
    let e = text(k.add_process_set(&[0, 0]));
    ensure!(e.contains("rank 0 is listed twice"), "{e}");
    let all: Vec<usize> = (0..size).collect();
    let set = k.add_process_set(&all)?;
    let s = k
        .allreduce("ok", f32s(vec![1.0])?)
        .op(ReduceOp::Sum)
        .process_set(&set)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(s == vec![size as f32]);
    k.remove_process_set(set)?;
    Ok(())
}

/// Two disjoint sets progress independently: while set A waits for a rank that has
/// not submitted, set B's ops complete. np 4: A = {0, 1}, B = {2, 3}.
pub(crate) fn independent(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let a = k.add_process_set(&[0, 1])?;
    let b = k.add_process_set(&[2, 3])?;
    if rank == 1 {
        // Waits in set A until rank 0 submits, which it does only after set B is done.
        let h = k
            .allreduce("w", f32s(vec![1.0])?)
            .op(ReduceOp::Sum)
            .process_set(&a)
            .submit()?;
        k.barrier()?;
        ensure!(h.wait()?.into_vec::<f32>()? == vec![2.0]);
    } else if rank == 0 {
        k.barrier()?;
        let s = k
            .allreduce("w", f32s(vec![1.0])?)
            .op(ReduceOp::Sum)
            .process_set(&a)
            .wait()?;
        ensure!(s.into_vec::<f32>()? == vec![2.0]);
    } else {
        // Set B's ops complete while set A has an op pending on rank 1.
        for i in 0..20 {
            let s = k
                .allreduce(format!("w{i}"), f32s(vec![1.0])?)
                .op(ReduceOp::Sum)
                .process_set(&b)
                .wait()?;
            ensure!(s.into_vec::<f32>()? == vec![2.0]);
        }
        k.barrier()?;
    }
    // A set is removed explicitly, or (b) when it is dropped.
    k.remove_process_set(a)?;
    drop(b);
    Ok(())
}
