//! A tour of kolo's core collectives on N ranks: run with
//! `mpirun -np 4 target/release/examples/core_demo`.

use kolo::{ReduceOp, Tensor};

fn main() -> anyhow::Result<()> {
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());

    // Allreduce: every rank contributes [rank, rank, rank].
    let t = Tensor::from_vec(vec![rank as f32; 3], &[3])?;
    let sum: Vec<f32> = kolo
        .allreduce("demo.sum", t)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec()?;

    // Asynchronous: submit many, then wait; ranks submit in different orders.
    let mut names: Vec<String> = (0..16).map(|i| format!("demo.async.{i}")).collect();
    if rank % 2 == 1 {
        names.reverse();
    }
    let handles = names
        .iter()
        .map(|n| {
            kolo.allreduce(n.as_str(), Tensor::from_vec(vec![1i64; 8], &[8])?)
                .op(ReduceOp::Sum)
                .submit()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut async_ok = true;
    for h in handles {
        async_ok &= h.wait()?.into_vec::<i64>()? == vec![size as i64; 8];
    }

    // Allgather with a different number of rows per rank.
    let rows = rank + 1;
    let g = kolo
        .allgather(
            "demo.gather",
            Tensor::from_vec(vec![rank as i32; rows * 2], &[rows, 2])?,
        )
        .wait()?;

    // Broadcast from the last rank.
    let b = kolo
        .broadcast(
            "demo.bcast",
            Tensor::from_vec(vec![rank as f64; 2], &[2])?,
            size - 1,
        )
        .wait()?;

    let stats = kolo.allgather_object("demo.host", (rank, std::process::id()))?;
    kolo.barrier()?;
    if rank == 0 {
        println!(
            "kolo core demo on {size} ranks (local size {})",
            kolo.local_size()
        );
        println!("  allreduce sum of ranks      = {:?}", sum);
        println!("  16 async allreduces correct = {async_ok}");
        println!("  allgather shape             = {:?}", g.shape());
        println!(
            "  broadcast from rank {}       = {:?}",
            size - 1,
            b.into_vec::<f64>()?
        );
        println!("  (rank, pid) of every rank   = {stats:?}");
    }
    kolo.shutdown()?;
    Ok(())
}
