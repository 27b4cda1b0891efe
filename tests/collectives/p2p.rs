//! Point to point (issue 36): send and recv between two ranks, around the engine's
//! cycles.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};

/// A ring of sends: each rank sends to the next and receives from the previous, under
/// one name, with collectives submitted in different orders on different ranks
/// between them; shapes and dtypes come from the sender. (A send completes when its
/// receive has run, so each rank waits for its send only after submitting what the
/// others need from it.)
pub(crate) fn ring(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    for step in 0..20 {
        let mine = Tensor::from_vec(vec![(rank * 100 + step) as i32; rank + 1], &[rank + 1])?;
        let sum_in = Tensor::from_vec(vec![1.0f32; 3], &[3])?;
        // Even ranks: receive, send, allreduce; odd ranks: allreduce first.
        let (got, sum) = if rank.is_multiple_of(2) {
            let r = k.recv("act", prev).submit()?;
            let s = k.send("act", mine, next).submit()?;
            let sum = k.allreduce("loss", sum_in).op(ReduceOp::Sum).wait()?;
            s.wait()?;
            (r.wait()?, sum)
        } else {
            let s = k.send("act", mine, next).submit()?;
            let sum = k.allreduce("loss", sum_in).op(ReduceOp::Sum).wait()?;
            let got = k.recv("act", prev).wait()?;
            s.wait()?;
            (got, sum)
        };
        ensure!(got.dtype() == DType::I32, "received {:?}", got.dtype());
        ensure!(
            got.shape() == [prev + 1],
            "received shape {:?}",
            got.shape()
        );
        let want = vec![(prev * 100 + step) as i32; prev + 1];
        ensure!(
            got.into_vec::<i32>()? == want,
            "step {step}: wrong data from rank {prev}"
        );
        ensure!(
            sum.into_vec::<f32>()? == vec![size as f32; 3],
            "allreduce beside the ring"
        );
    }
    // A rank that shut down now would fail the pairs still running between others.
    k.barrier()?;
    Ok(())
}

/// Every dtype, an empty tensor and 16 MiB between ranks 0 and 1, many in flight at
/// once, received in another order than sent.
pub(crate) fn dtypes_sizes_in_flight(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let tensors = || -> Result<Vec<Tensor>> {
        Ok(vec![
            Tensor::from_vec(vec![1u8, 2, 3], &[3])?,
            Tensor::from_vec(vec![-1i8, 2], &[2])?,
            Tensor::from_vec(vec![7i32; 4], &[2, 2])?,
            Tensor::from_vec(vec![-9i64], &[1])?,
            Tensor::from_vec(vec![kolo::half::f16::from_f32(1.5); 2], &[2])?,
            Tensor::from_vec(vec![kolo::half::bf16::from_f32(-2.5); 3], &[3])?,
            Tensor::from_vec(Vec::<f32>::new(), &[0, 5])?,
            Tensor::from_vec(vec![0.25f64; 5], &[5])?,
            Tensor::from_vec(
                (0..(4 << 20)).map(|i| i as f32).collect::<Vec<f32>>(),
                &[4 << 20],
            )?,
        ])
    };
    if rank == 0 {
        let handles = tensors()?
            .into_iter()
            .enumerate()
            .map(|(i, t)| k.send(format!("t{i}"), t, 1).submit())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for h in handles {
            h.wait()?;
        }
    } else if rank == 1 {
        let want = tensors()?;
        let handles = (0..want.len())
            .rev()
            .map(|i| k.recv(format!("t{i}"), 0).submit().map(|h| (i, h)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (i, h) in handles {
            let got = h.wait()?;
            ensure!(got == want[i], "t{i}: received {got:?}");
        }
    }
    k.barrier()?;
    Ok(())
}

/// Two pairs use the same name at once (0 → 1 and 2 → 3): each gets its own tensor.
pub(crate) fn same_name_other_pairs(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let peer = rank ^ 1;
    let big: Vec<f32> = (0..(1 << 20)).map(|i| (i + rank) as f32).collect();
    if peer >= k.size() {
        // The odd one out at an odd np: no partner.
    } else if rank.is_multiple_of(2) {
        k.send("grad.stage", Tensor::from_vec(big, &[1 << 20])?, peer)
            .wait()?;
    } else {
        let got = k.recv("grad.stage", peer).wait()?.into_vec::<f32>()?;
        let want: Vec<f32> = (0..(1 << 20)).map(|i| (i + peer) as f32).collect();
        ensure!(got == want, "rank {rank} got another pair's tensor");
    }
    k.barrier()?;
    Ok(())
}

/// Bad arguments are refused at submit, naming the rank; the tensor comes back.
pub(crate) fn errors(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    let e = match k.send("x", t, rank).submit() {
        Ok(_) => anyhow::bail!("a send to this rank was accepted"),
        Err(e) => e,
    };
    ensure!(e.to_string().contains("is this rank"), "{e}");
    let back = e.into_tensors();
    ensure!(
        back.len() == 1 && back[0].as_slice::<f32>()? == [1.0, 2.0],
        "not handed back"
    );
    let e = k
        .recv("x", size)
        .submit()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        e.contains(&format!("source rank {size} is out of range")),
        "{e}"
    );
    let e = k
        .recv("", (rank + 1) % size)
        .submit()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(e.contains("must not be empty"), "{e}");
    // Issue 53 item 25: a receive of a reserved name is refused (it was accepted and
    // waited for ever: no send of it can be made).
    let e = error_text(k.recv("@x", (rank + 1) % size).wait());
    ensure!(e.contains("names starting with '@' are reserved"), "{e}");
    // The longest name and the most dimensions a header holds: refused one past them
    // (the tensor comes back); at them, the tensor arrives whole.
    let (peer, long) = ((rank + 1) % size, "n".repeat(1025));
    let e = match k
        .send(long.as_str(), Tensor::from_vec(vec![1u8], &[1])?, peer)
        .submit()
    {
        Ok(_) => anyhow::bail!("a send with a 1025-byte name was accepted"),
        Err(e) => e,
    };
    ensure!(e.to_string().contains("takes at most 1024"), "{e}");
    ensure!(e.into_tensors().len() == 1, "not handed back");
    let e = error_text(k.recv(long.as_str(), peer).wait());
    ensure!(e.contains("takes at most 1024"), "{e}");
    let e = error_text(
        k.send("x", Tensor::from_vec(vec![1u8], &[1; 65])?, peer)
            .wait(),
    );
    ensure!(
        e.contains("has 65 dimensions; send takes at most 64"),
        "{e}"
    );
    let mut shape = vec![1usize << 62; 64];
    shape[0] = 0;
    let (name, edge) = (
        "e".repeat(1024),
        Tensor::from_vec(Vec::<f64>::new(), &shape)?,
    );
    match rank {
        0 => k.send(name.as_str(), edge, 1).wait()?,
        1 => {
            let got = k.recv(name.as_str(), 0).wait()?;
            ensure!(
                got.shape() == shape && got.dtype() == DType::F64,
                "edge: {got:?}"
            );
        }
        _ => {}
    }
    k.barrier()?;
    Ok(())
}

/// Pipeline stages inside a process set of ranks 1 and 2: set rank 0 sends to set
/// rank 1; rank 0 of the job takes no part.
pub(crate) fn in_process_set(k: &Kolo) -> Result<()> {
    let set = k.add_process_set(&[1, 2])?;
    match set.rank() {
        Some(0) => {
            let t = Tensor::from_vec(vec![7u8, 8, 9], &[3])?;
            k.send("stage", t, 1).process_set(&set).wait()?;
        }
        Some(_) => {
            let got = k.recv("stage", 0).process_set(&set).wait()?;
            ensure!(got.into_vec::<u8>()? == [7, 8, 9], "wrong data in the set");
        }
        None => {}
    }
    k.barrier()?;
    k.remove_process_set(set)?;
    Ok(())
}

/// Runs `pair` on ranks 0 and 1 while the last rank is stopped: right after a barrier
/// it stops itself (SIGSTOP), and rank 0 continues it (SIGCONT) once `pair` returns,
/// or after 20 s at the latest, so that a failure is not a hang. `pair` gets this
/// rank and returns how long its part took, which must stay under `limit`.
fn while_last_rank_stopped(
    k: &Kolo,
    tag: &str,
    limit: Duration,
    pair: impl FnOnce(usize) -> Result<Duration>,
) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let pids: Vec<i32> = k.allgather_object(format!("{tag}.pids"), std::process::id() as i32)?;
    let last = size - 1;
    k.barrier()?;
    if rank == last {
        // SAFETY: stopping our own process; rank 0 continues it.
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
    } else if rank < 2 {
        let pid = pids[last];
        let fallback = (rank == 0).then(|| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(20));
                // SAFETY: continuing a rank of this job.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            })
        });
        let took = pair(rank);
        if rank == 0 {
            // SAFETY: continuing a rank of this job.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
        drop(fallback);
        let took = took?;
        ensure!(
            took < limit,
            "{tag}: took {took:?} while rank {last} was stopped"
        );
    }
    k.barrier()?;
    Ok(())
}

/// One round trip of 4 floats between ranks 0 and 1 under `key` (rank 1 adds one,
/// after `reply_after`).
fn round_trip(k: &Kolo, rank: usize, key: &str, i: u32, reply_after: Duration) -> Result<()> {
    if rank == 0 {
        let t = Tensor::from_vec(vec![i as f32; 4], &[4])?;
        k.send(key, t, 1).wait()?;
        let back = k.recv(key, 1).wait()?;
        ensure!(back.as_slice::<f32>()? == [i as f32 + 1.0; 4], "round {i}");
    } else {
        let got = k.recv(key, 0).wait()?;
        std::thread::sleep(reply_after);
        let v: Vec<f32> = got.as_slice::<f32>()?.iter().map(|x| x + 1.0).collect();
        k.send(key, Tensor::from_vec(v, &[4])?, 0).wait()?;
    }
    Ok(())
}

/// A pair needs no other rank (issue 36): ranks 0 and 1 exchange 100 round trips while
/// the last rank is stopped. Through the cycles the pair would wait for the stopped
/// rank's part of the next cycle agreement. After the first 300 ms the engine thread
/// sits in a heartbeat's agreement that cannot end, moving sends and receives while
/// it waits: all 100 (the best of three batches) within 10× the time the same 100
/// take with every rank running, and at least 150 ms (0.13–0.17 ms each here; 3.5 ms
/// each when that wait napped 1 ms at a time, deaf to submits; held until the stopped
/// rank continues when it waited for it). A ratio, as the machine's load sets both
/// times (a fixed 150 ms failed once at 211 ms on a loaded machine; CI failed the case
/// once at np 4, rank 0's reason lost, most likely this limit: hence the best of three).
pub(crate) fn pair_alone(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let start = Instant::now();
    if rank < 2 {
        for i in 0..100u32 {
            round_trip(k, rank, &format!("pingpong.base.{i}"), i, Duration::ZERO)?;
        }
    }
    let base = start.elapsed();
    let limit = (base * 10).max(Duration::from_millis(150));
    while_last_rank_stopped(k, "p2p.alone", limit, |rank| {
        // Let the last rank stop first, and a heartbeat come due.
        std::thread::sleep(Duration::from_millis(300));
        // The best of three batches: a load spike on a shared machine can slow one
        // batch past the limit; the faults this catches slow every batch.
        let mut best = Duration::MAX;
        for batch in 0..3u32 {
            let start = Instant::now();
            for i in 0..100u32 {
                let key = format!("pingpong.{batch}.{i}");
                round_trip(k, rank, &key, i, Duration::ZERO)?;
            }
            best = best.min(start.elapsed());
        }
        Ok(best)
    })
}

/// A thread waiting on its own send or receive runs the engine itself, but never a
/// heartbeat cycle: that waits for every rank's heartbeat, and the waiter would wait
/// with it after its op completed (a pipeline stage lost 40-100 ms at a time so). The
/// last rank stops itself right after a barrier, so no heartbeat agreement can end
/// while it is stopped; ranks 0 and 1 exchange round trips for about 300 ms (three
/// heartbeats), rank 1 replying after 5 ms so that rank 0 is waiting (driving) when
/// they come due. A waiter that ran a heartbeat would be held until rank 0 continues
/// the stopped rank (after the pair is done; after 20 s at the latest).
pub(crate) fn pair_alone_past_heartbeats(k: &Kolo) -> Result<()> {
    while_last_rank_stopped(k, "p2p.heartbeats", Duration::from_secs(5), |rank| {
        let start = Instant::now();
        let mut rounds = 0u32;
        loop {
            let reply_after = Duration::from_millis(5);
            round_trip(
                k,
                rank,
                &format!("hb.pingpong.{rounds}"),
                rounds,
                reply_after,
            )?;
            rounds += 1;
            // Rank 0 decides when to stop and tells rank 1: both run the same rounds.
            let key = format!("hb.more.{rounds}");
            let go_on = if rank == 0 {
                let go_on = start.elapsed() < Duration::from_millis(300) || rounds < 10;
                let flag = Tensor::from_vec(vec![u8::from(go_on)], &[1])?;
                k.send(key.as_str(), flag, 1).wait()?;
                go_on
            } else {
                k.recv(key.as_str(), 0).wait()?.as_slice::<u8>()? == [1]
            };
            if !go_on {
                return Ok(start.elapsed());
            }
        }
    })
}

/// A receive whose sender has not sent is reported by the stall inspector, naming
/// both ranks and the name (with `KOLO_STALL_CHECK_TIME_SECONDS=1`); the send then
/// comes and both complete.
pub(crate) fn stalled_recv(k: &Kolo) -> Result<()> {
    match k.rank() {
        0 => {
            std::thread::sleep(Duration::from_millis(2500));
            k.send("late.x", Tensor::from_vec(vec![5u8], &[1])?, 1)
                .wait()?;
        }
        1 => {
            let got = k.recv("late.x", 0).wait()?;
            ensure!(got.as_slice::<u8>()? == [5], "wrong data");
        }
        _ => {}
    }
    k.barrier()?;
    Ok(())
}

/// The error text of `r`, or "" when it succeeded.
fn error_text<T>(r: kolo::Result<T>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

/// Blocking sends and receives, which run on the caller's thread while the engine is
/// idle (no queue, no handle): bad arguments give the submit-time errors; a receive
/// whose name is pending already is refused; a receive whose tensor comes 30 ms late
/// and a send whose receiver comes 300 ms late then wait in the engine, their names
/// claimed (a second send of the name is refused meanwhile); and two threads of a
/// rank exchange round trips while a third runs allreduces.
pub(crate) fn blocking_paths(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let one = || Tensor::from_vec(vec![1.0f32], &[1]);
    let e = error_text(k.send("x", one()?, rank).wait());
    ensure!(e.contains("is this rank"), "send to self: {e:?}");
    let e = error_text(k.send("x", one()?, size).wait());
    ensure!(
        e.contains(&format!("destination rank {size} is out of range")),
        "send out of range: {e:?}"
    );
    let e = error_text(k.recv("", (rank + 1) % size).wait());
    ensure!(e.contains("must not be empty"), "empty name: {e:?}");
    k.barrier()?;
    let big = || Tensor::from_vec((0..(4 << 20)).map(|i| i as f32).collect(), &[4 << 20]);
    let pids: Vec<i32> = k.allgather_object("blocking.pids", std::process::id() as i32)?;
    match rank {
        0 => {
            std::thread::sleep(Duration::from_millis(30));
            k.send("late", Tensor::from_vec(vec![3i32; 5], &[5])?, 1)
                .wait()?;
            // Rank 1 stops itself (so that nothing there takes the big send in early):
            // the send waits in the engine with its name claimed.
            wait_until_stopped(pids[1])?;
            let resume = Resume(pids[1]);
            std::thread::scope(|s| -> Result<()> {
                let sending = s.spawn(|| k.send("big", big()?, 1).wait());
                std::thread::sleep(Duration::from_millis(50));
                let e = match k.send("big", one()?, 1).submit() {
                    Ok(_) => String::new(),
                    Err(e) => e.to_string(),
                };
                drop(resume);
                ensure!(
                    e.contains("already pending on rank 0"),
                    "second send: {e:?}"
                );
                match sending.join() {
                    Ok(r) => Ok(r?),
                    Err(_) => anyhow::bail!("the sending thread panicked"),
                }
            })?;
            k.send("dup", one()?, 1).wait()?;
        }
        1 => {
            let pending = k.recv("dup", 0).submit()?;
            let e = error_text(k.recv("dup", 0).wait());
            ensure!(
                e.contains("already pending on rank 1"),
                "second recv: {e:?}"
            );
            let late = k.recv("late", 0).wait()?;
            ensure!(late.as_slice::<i32>()? == [3; 5], "late: {late:?}");
            // SAFETY: stopping our own process; rank 0 continues it.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
            let got = k.recv("big", 0).wait()?;
            ensure!(got == big()?, "big: wrong data");
            let dup = pending.wait()?;
            ensure!(dup.as_slice::<f32>()? == [1.0], "dup: {dup:?}");
        }
        _ => {}
    }
    k.barrier()?;
    // Two threads per rank of the pair each exchange round trips under their own
    // name while the main thread of every rank runs allreduces.
    std::thread::scope(|s| -> Result<()> {
        let pairs: Vec<_> = (0..2)
            .filter(|_| rank < 2)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    let key = format!("rt.{t}");
                    for i in 0..200 {
                        round_trip(k, rank, &key, i, Duration::ZERO)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for i in 0..50 {
            let t = Tensor::from_vec(vec![1.0f32; 16], &[16])?;
            let sum = k.allreduce(format!("ar.{i}"), t).op(ReduceOp::Sum).wait()?;
            ensure!(sum.as_slice::<f32>()? == [size as f32; 16], "allreduce {i}");
        }
        for p in pairs {
            match p.join() {
                Ok(r) => r?,
                Err(_) => anyhow::bail!("a round-trip thread panicked"),
            }
        }
        Ok(())
    })?;
    k.barrier()?;
    Ok(())
}

/// Waits (up to 10 s) until process `pid` is stopped.
fn wait_until_stopped(pid: i32) -> Result<()> {
    let start = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // The state follows the command's closing parenthesis.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        if state == Some('T') {
            return Ok(());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "rank never stopped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Continues a stopped process when dropped.
struct Resume(i32);

impl Drop for Resume {
    fn drop(&mut self) {
        // SAFETY: continuing a rank of this job.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// A thread of rank 0 waits in a blocking receive that rank 1 never sends while rank
/// 0's main thread shuts it down: the receive fails naming the shutdown, and nothing
/// hangs (the receive went past its spin on the caller's thread and waits in the
/// engine, which fails it as it stops).
pub(crate) fn shutdown_while_receiving(k: &Kolo) -> Result<()> {
    if k.rank() == 0 {
        std::thread::scope(|s| -> Result<()> {
            let waiter = s.spawn(|| error_text(k.recv("never.sent", 1).wait()));
            std::thread::sleep(Duration::from_millis(200));
            k.shutdown()?;
            let e = match waiter.join() {
                Ok(e) => e,
                Err(_) => anyhow::bail!("the receiving thread panicked"),
            };
            ensure!(
                e.contains("shut down"),
                "the waiting receive ended with {e:?}"
            );
            Ok(())
        })
    } else {
        k.shutdown()?;
        Ok(())
    }
}

/// Run with `KOLO_CYCLE_TIME=200`: an async send nobody waits for is posted at once,
/// not after the engine thread's grace (a cycle time, in which it leaves a burst of
/// submits to their caller): rank 1's blocking receive has it within 100 ms of rank
/// 0's submit while rank 0 sleeps.
pub(crate) fn async_send_unwaited(k: &Kolo) -> Result<()> {
    k.barrier()?;
    // Let the engine threads go idle.
    std::thread::sleep(Duration::from_millis(300));
    match k.rank() {
        0 => {
            let h = k
                .send("unwaited", Tensor::from_vec(vec![7u8; 4], &[4])?, 1)
                .submit()?;
            std::thread::sleep(Duration::from_millis(400));
            h.wait()?;
        }
        1 => {
            let start = Instant::now();
            let got = k.recv("unwaited", 0).wait()?;
            let took = start.elapsed();
            ensure!(got.as_slice::<u8>()? == [7; 4], "wrong data");
            // Rank 1 starts waiting about when rank 0 submits (both left the same
            // barrier 300 ms before).
            ensure!(
                took < Duration::from_millis(100),
                "the unwaited send arrived after {took:?}"
            );
        }
        _ => {}
    }
    k.barrier()?;
    Ok(())
}

/// The CPU time this process has used.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct passed.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// A rank waiting in a blocking receive for a sender that sends 400 ms later sleeps:
/// it polls for 1 ms, then naps (nothing is in flight), so the wait costs its process
/// under a tenth of a core (~3% here; ~25% when it yields the whole wait instead).
/// Ranks 0 and 1 each wait in turn.
pub(crate) fn waiting_recv_sleeps(k: &Kolo) -> Result<()> {
    for waiter in [0, 1] {
        k.barrier()?;
        match k.rank() {
            r if r == waiter => {
                let (wall, cpu) = (Instant::now(), cpu_time());
                let got = k.recv("late", 1 - waiter).wait()?;
                let (wall, cpu) = (wall.elapsed(), cpu_time() - cpu);
                ensure!(got.as_slice::<f32>()? == [1.0; 3], "wrong data");
                ensure!(
                    wall >= Duration::from_millis(300),
                    "the receive returned after {wall:?}, before the send"
                );
                ensure!(
                    cpu < wall / 10,
                    "rank {r} used {cpu:?} of CPU waiting {wall:?} for a receive"
                );
            }
            r if r == 1 - waiter => {
                std::thread::sleep(Duration::from_millis(400));
                k.send("late", Tensor::from_vec(vec![1.0f32; 3], &[3])?, waiter)
                    .wait()?;
            }
            _ => {}
        }
    }
    k.barrier()?;
    Ok(())
}

/// Run with `KOLO_FAULT_P2P_AS_DEVICE=1` (feature fault-injection): every tensor
/// travels marked as sent from a device. Without a usable CUDA device (CI), rank 1's
/// receive (blocking, then submitted) fails naming the tensor, the sender and why this
/// rank cannot put it on a device, and the ranks go on working; with one, each arrives
/// on rank 1's `cuda_device` with the values sent.
#[cfg(feature = "fault-injection")]
pub(crate) fn device_flag_without_gpu(k: &Kolo) -> Result<()> {
    match k.rank() {
        0 => {
            for name in ["as_device.0", "as_device.1"] {
                k.send(name, Tensor::from_vec(vec![1.0f32; 4], &[4])?, 1)
                    .wait()?;
            }
        }
        1 => {
            let gpu = k.cuda_device().ok();
            let blocking = k.recv("as_device.0", 0).wait();
            let submitted = k.recv("as_device.1", 0).submit()?.wait();
            for (name, got) in [("as_device.0", blocking), ("as_device.1", submitted)] {
                match (got, gpu) {
                    (Ok(t), Some(i)) => {
                        ensure!(
                            t.device() == kolo::Device::Cuda(i),
                            "{name} on {}",
                            t.device()
                        );
                        #[cfg(feature = "nccl")]
                        let t = t.to_cpu()?;
                        ensure!(t.into_vec::<f32>()? == [1.0; 4], "{name} changed");
                        println!("DEVICE_FLAG {name} on cuda:{i}");
                    }
                    (Ok(t), None) => {
                        anyhow::bail!("{name} arrived on {} without a GPU", t.device())
                    }
                    (Err(e), None) => {
                        let msg = e.to_string();
                        let want = format!(
                            "\"{name}\" from rank 0 was sent from a CUDA device, and this rank cannot put it on its own"
                        );
                        ensure!(msg.contains(&want), "{name}: {msg}");
                        println!("DEVICE_FLAG {msg}");
                    }
                    (Err(e), Some(i)) => anyhow::bail!("{name} failed with cuda:{i} here: {e}"),
                }
            }
        }
        _ => {}
    }
    let sum = k
        .allreduce("after", Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(sum == [k.size() as f32], "allreduce after gave {sum:?}");
    Ok(())
}

/// Issue 53 item 25: two threads of rank 1 receive the same name from rank 0 at once,
/// 20 times: in each round exactly one gets the tensor and the other is refused as a
/// duplicate (it got "the engine stopped" when the second receive replaced the first
/// in the engine).
pub(crate) fn racing_receives(k: &Kolo) -> Result<()> {
    for round in 0..20 {
        let name = format!("race.{round}");
        match k.rank() {
            0 => {
                std::thread::sleep(Duration::from_millis(5 + (round % 4) * 10));
                let t = Tensor::from_vec(vec![round as i32; 3], &[3])?;
                k.send(name.as_str(), t, 1).wait()?;
            }
            1 => {
                let (a, b) = std::thread::scope(|s| {
                    let a = s.spawn(|| k.recv(name.as_str(), 0).wait());
                    let b = s.spawn(|| k.recv(name.as_str(), 0).wait());
                    (a.join(), b.join())
                });
                let (Ok(a), Ok(b)) = (a, b) else {
                    anyhow::bail!("a receiving thread panicked");
                };
                let (got, refused) = match (a, b) {
                    (Ok(t), Err(e)) | (Err(e), Ok(t)) => (t, e.to_string()),
                    (Ok(_), Ok(_)) => anyhow::bail!("round {round}: both receives got a tensor"),
                    (Err(a), Err(b)) => anyhow::bail!("round {round}: both failed: {a}; {b}"),
                };
                ensure!(
                    got.as_slice::<i32>()? == [round as i32; 3],
                    "round {round}: {got:?}"
                );
                ensure!(
                    refused.contains("already pending on rank 1"),
                    "round {round}: the second receive: {refused:?}"
                );
            }
            _ => {}
        }
    }
    k.barrier()?;
    Ok(())
}

/// Issue 53 item 20 (with `KOLO_STALL_SHUTDOWN_TIME_SECONDS=2`): a receive whose
/// sender never sends fails after the stall shutdown time, naming both ranks and the
/// name, instead of waiting for ever; point to point and collectives go on after it.
pub(crate) fn stalled_recv_fails(k: &Kolo) -> Result<()> {
    // The other ranks reach the next collective soon after rank 1's receive fails:
    // a collective awaited for 2 s would trip the same shutdown time.
    match k.rank() {
        1 => {
            let start = Instant::now();
            let e = error_text(k.recv("never.sent", 0).wait());
            let took = start.elapsed();
            ensure!(
                e.contains("recv \"never.sent\" on rank 1: rank 0 has not sent it within 2 s"),
                "{e:?}"
            );
            ensure!(
                took >= Duration::from_millis(1900) && took < Duration::from_secs(10),
                "failed after {took:?}"
            );
        }
        _ => std::thread::sleep(Duration::from_millis(2300)),
    }
    let t = k.allreduce("after.stall", Tensor::from_vec(vec![1.0f32], &[1])?);
    let sum = t.op(ReduceOp::Sum).wait()?;
    ensure!(sum.as_slice::<f32>()? == [k.size() as f32], "{sum:?}");
    match k.rank() {
        0 => k
            .send("after", Tensor::from_vec(vec![9u8], &[1])?, 1)
            .wait()?,
        1 => {
            let t = k.recv("after", 0).wait()?;
            ensure!(t.as_slice::<u8>()? == [9], "{t:?}");
        }
        _ => {}
    }
    k.barrier()?;
    println!("P2P_STALL_FAILED_AND_WENT_ON");
    Ok(())
}

/// Issue 53 item 18 (fault-injection: `KOLO_FAULT_P2P_DATA_FAIL=broken.a`, and
/// `KOLO_STALL_SHUTDOWN_TIME_SECONDS=2`): rank 0's send of `broken.a` fails after its
/// header went out. Its next send to rank 1 fails too, naming the broken stream,
/// instead of going out and being taken by rank 1 as `broken.a`'s bytes; rank 1's
/// receive of `broken.a` never completes with the wrong tensor (it fails after the
/// stall shutdown time). Sends to other ranks and collectives are unaffected.
#[cfg(feature = "fault-injection")]
pub(crate) fn broken_stream(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let big = |v: f32| Tensor::from_vec(vec![v; 16 << 10], &[16 << 10]);
    match rank {
        0 => {
            let e = error_text(k.send("broken.a", big(1.0)?, 1).wait());
            ensure!(e.contains("KOLO_FAULT_P2P_DATA_FAIL"), "broken.a: {e:?}");
            let e = error_text(k.send("broken.b", big(2.0)?, 1).wait());
            ensure!(
                e.contains("point to point to rank 1 broke at an earlier send"),
                "broken.b: {e:?}"
            );
            if size > 2 {
                k.send("fine", big(3.0)?, 2).wait()?;
            }
        }
        1 => {
            let r = k.recv("broken.a", 0).wait();
            ensure!(
                r.is_err(),
                "rank 1 received a tensor as \"broken.a\" (the next send's bytes): {:?}",
                r.ok()
                    .map(|t| t.as_slice::<f32>().map(|s| s[0]).unwrap_or(f32::NAN))
            );
            let e = error_text(r);
            ensure!(e.contains("has not sent it within 2 s"), "{e:?}");
        }
        2 => {
            let t = k.recv("fine", 0).wait()?;
            ensure!(t == big(3.0)?, "fine: wrong data");
        }
        _ => {}
    }
    // Near rank 1, whose receive fails after 2 s: a collective awaited for 2 s would
    // trip the same shutdown time.
    if rank != 1 {
        std::thread::sleep(Duration::from_millis(2300));
    }
    k.barrier()?;
    println!("P2P_BROKEN_STREAM_REFUSED");
    Ok(())
}
