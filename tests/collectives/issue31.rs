//! Regression cases of issue 31 (the reliability review): hangs, lost data and
//! transport errors that must reach the caller.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use kolo::{DType, DistributedOptimizer, Error, GradientStep, Gradients, Kolo, ReduceOp, Tensor};

/// Item 1: the same group members listed in another order on every rank (as a list
/// built from a `HashMap` is) negotiate as one group; each rank gets its results in
/// its own order.
pub(crate) fn grouped_member_order(k: &Kolo) -> Result<()> {
    let names = ["alpha", "beta", "gamma", "delta"];
    let (rank, size) = (k.rank(), k.size());
    // Rank r starts the list at member r: a different order on every rank. Rank 0 also
    // changes its order from one call to the next, and comes back to the first one:
    // each list's plan is kept, and must be that very order's (a plan reused for
    // another order would send rank 0's tensors under other names than the others').
    for round in [0, 1, 0, 3] {
        let shift = if rank == 0 { round } else { 0 };
        let order: Vec<usize> = (0..names.len())
            .map(|i| (i + rank + shift) % names.len())
            .collect();
        let members = order
            .iter()
            .map(|&m| {
                let t = Tensor::from_vec(vec![(m * 10 + rank) as f32; m + 1], &[m + 1])?;
                Ok((names[m].to_string(), t))
            })
            .collect::<Result<Vec<_>>>()?;
        let h = k.grouped_allreduce(members).op(ReduceOp::Sum).submit()?;
        let wait = std::thread::spawn(move || h.wait());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !wait.is_finished() {
            ensure!(
                std::time::Instant::now() < deadline,
                "grouped allreduce with members in another order did not return in 30 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let outs = match wait.join() {
            Ok(r) => r?,
            Err(_) => bail!("the waiting thread panicked"),
        };
        let ranks: usize = (0..size).sum();
        for (&m, out) in order.iter().zip(outs) {
            ensure!(
                out.shape() == [m + 1],
                "member {} has shape {:?} (shift {shift})",
                names[m],
                out.shape()
            );
            let want = (m * 10 * size + ranks) as f32;
            let got = out.into_vec::<f32>()?;
            ensure!(
                got.iter().all(|&v| v == want),
                "member {} (listed at another place on rank {rank}, shift {shift}): {got:?}, expected {want}",
                names[m]
            );
        }
    }
    Ok(())
}

/// Items 7 and 8: a broadcast of parameters where one parameter's shape differs
/// between ranks fails on every rank, and the caller's map keeps every entry: the
/// good one broadcast, the bad one its own tensor, unchanged.
pub(crate) fn broadcast_parameters_keeps_entries(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let mut params = BTreeMap::new();
    params.insert(
        "a".to_string(),
        Tensor::from_vec(vec![rank as f32; 3], &[3])?,
    );
    // Rank r's "b" has r + 1 elements: a shape mismatch at every np > 1.
    let b = vec![rank as f32 + 0.5; rank + 1];
    params.insert("b".to_string(), Tensor::from_vec(b.clone(), &[rank + 1])?);
    let err = match kolo::broadcast_parameters(k, &mut params, 0) {
        Ok(()) => bail!("broadcast_parameters with mismatched shapes succeeded"),
        Err(e) => e,
    };
    ensure!(
        err.to_string().contains("shape mismatch") && err.to_string().contains("param.b"),
        "unexpected error: {err}"
    );
    ensure!(
        params.len() == 2,
        "{} entries left of 2 after the failed broadcast",
        params.len()
    );
    let a = params
        .remove("a")
        .map(|t| t.into_vec::<f32>())
        .transpose()?;
    ensure!(
        a == Some(vec![0.0; 3]),
        "\"a\" is {a:?}, not rank 0's values"
    );
    let got = params
        .remove("b")
        .map(|t| t.into_vec::<f32>())
        .transpose()?;
    ensure!(
        got == Some(b),
        "\"b\" is {got:?}, not this rank's own tensor"
    );
    Ok(())
}

/// Item 8: an accepted op that fails before it runs (a mismatch across ranks) hands
/// this rank's tensor back, in the caller's order for a group.
pub(crate) fn failed_ops_hand_back(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let mine = vec![rank as f32; rank + 1];
    let t = Tensor::from_vec(mine.clone(), &[rank + 1])?;
    let err = match k.allreduce("mismatch", t).submit()?.wait_or_return() {
        Ok(_) => bail!("an allreduce with another shape on every rank succeeded"),
        Err(e) => e,
    };
    ensure!(
        matches!(err.error(), Error::Mismatch { .. }),
        "not a mismatch: {err}"
    );
    let back = err.into_tensors();
    ensure!(back.len() == 1, "{} tensors handed back, not 1", back.len());
    let back = back
        .into_iter()
        .next()
        .map(|t| t.into_vec::<f32>())
        .transpose()?;
    ensure!(back == Some(mine), "handed back {back:?}");
    // A group, listed out of name order, whose second member differs in shape.
    let members = vec![
        ("z".to_string(), Tensor::from_vec(vec![1.0f32; 2], &[2])?),
        (
            "y".to_string(),
            Tensor::from_vec(vec![2.0f32; rank + 1], &[rank + 1])?,
        ),
    ];
    let err = match k.grouped_allreduce(members).submit()?.wait_or_return() {
        Ok(_) => bail!("a group with another shape on every rank succeeded"),
        Err(e) => e,
    };
    let back: Vec<Vec<f32>> = err
        .into_tensors()
        .into_iter()
        .map(|t| t.into_vec::<f32>())
        .collect::<std::result::Result<_, _>>()?;
    ensure!(
        back == [vec![1.0; 2], vec![2.0; rank + 1]],
        "group handed back {back:?}, not in the caller's order"
    );
    Ok(())
}

struct Keep;

impl GradientStep for Keep {
    fn step(
        &mut self,
        _: &Gradients,
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(())
    }
}

/// Items 8 and 9: a gradient the optimizer refuses comes back in the error, and the
/// optimizer's state is unchanged (a later, valid window still works).
pub(crate) fn optimizer_refusals_hand_back(k: &Kolo) -> Result<()> {
    let mut opt = DistributedOptimizer::builder(k.clone(), Keep)
        .param("w", &[2], DType::F32)
        .param("n", &[2], DType::I32)
        .backward_passes_per_step(2)
        .op(ReduceOp::Sum)
        .build()?;
    let refused = |r: std::result::Result<(), kolo::SubmitError>| -> Result<Vec<Tensor>> {
        match r {
            Ok(()) => bail!("a gradient that must be refused was accepted"),
            Err(e) => Ok(e.into_tensors()),
        }
    };
    let back = refused(opt.submit_gradient("nope", Tensor::from_vec(vec![7.0f32; 2], &[2])?))?;
    ensure!(
        back.len() == 1 && back[0].as_slice::<f32>()? == [7.0, 7.0],
        "unknown name: {back:?}"
    );
    // Integer gradients cannot be summed locally over 2 passes: refused up front.
    let back = refused(opt.submit_gradient("n", Tensor::from_vec(vec![3i32; 2], &[2])?))?;
    ensure!(
        back.len() == 1 && back[0].as_slice::<i32>()? == [3, 3],
        "i32 accumulation: {back:?}"
    );
    opt.submit_gradient("w", Tensor::from_vec(vec![1.0f32; 2], &[2])?)?;
    let back = refused(opt.submit_gradient("w", Tensor::from_vec(vec![1.0f32; 3], &[3])?))?;
    ensure!(
        back.len() == 1 && back[0].len() == 3,
        "wrong shape: {back:?}"
    );
    // The partial sum survived the refusals: the window completes with both passes.
    opt.submit_gradient("w", Tensor::from_vec(vec![3.0f32; 2], &[2])?)?;
    opt.synchronize()?;
    let w = opt.gradients()["w"].as_slice::<f32>()?.to_vec();
    // Sum over ranks of the window's average (1 + 3) / 2.
    let want = 2.0 * k.size() as f32;
    ensure!(w == [want, want], "reduced gradient {w:?}, expected {want}");
    Ok(())
}

/// Item 13: an object of more than 2^31 bytes is broadcast (MPI counts are C ints).
pub(crate) fn broadcast_object_2gib(k: &Kolo) -> Result<()> {
    const LEN: usize = (1 << 31) + 9;
    let object = if k.rank() == 0 {
        let mut v = vec![0u8; LEN];
        v[0] = 1;
        v[LEN / 2] = 2;
        v[LEN - 1] = 3;
        v
    } else {
        Vec::new()
    };
    let got: Vec<u8> = k.broadcast_object("huge", object, 0)?;
    ensure!(got.len() == LEN, "received {} bytes, not {LEN}", got.len());
    ensure!(
        (got[0], got[LEN / 2], got[LEN - 1]) == (1, 2, 3),
        "received the wrong bytes"
    );
    Ok(())
}

/// Item 14 (feature fault-injection, `KOLO_FAULT_MPI_BAD_ROOT=1`): MPI itself fails
/// a broadcast; the error reaches the caller as `Error::Transport` on every rank
/// instead of MPI aborting the job, and later ops still work.
#[cfg(feature = "fault-injection")]
pub(crate) fn mpi_error_returns(k: &Kolo) -> Result<()> {
    let t = Tensor::from_vec(vec![1.0f32; 4], &[4])?;
    match k.broadcast("bad_root", t, 0).wait() {
        Ok(_) => bail!("the injected MPI error did not fail the broadcast"),
        Err(Error::Transport { call, message }) => {
            ensure!(call == "MPI_Bcast", "error from {call}: {message}");
            println!("TRANSPORT_ERROR {call}: {message}");
        }
        Err(e) => bail!("not a transport error: {e}"),
    }
    let sum = k
        .allreduce("after", Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(
        sum == [k.size() as f32],
        "allreduce after the error gave {sum:?}"
    );
    Ok(())
}

/// Item 3: process sets added on one thread while another shuts kolo down: every
/// call returns (a set, or an error saying kolo stopped or a rank left), and the job
/// ends cleanly — MPI is never finalised under a set's engine.
pub(crate) fn shutdown_races_add_process_set(k: &Kolo) -> Result<()> {
    let adder = k.clone();
    let all: Vec<usize> = (0..k.size()).collect();
    let t = std::thread::spawn(move || {
        let mut made = 0usize;
        loop {
            match adder.add_process_set(&all) {
                Ok(_) => made += 1,
                Err(e) => return (made, e.to_string()),
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    k.shutdown()?;
    let (made, why) = t
        .join()
        .map_err(|_| anyhow::anyhow!("the thread adding process sets panicked"))?;
    ensure!(
        why.contains("shut") || why.contains("not running"),
        "add_process_set ended with an unexpected error after {made} sets: {why}"
    );
    Ok(())
}
