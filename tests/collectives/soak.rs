//! Soak: 20 000 mixed ops with random sizes, submitted in a different random order on
//! every rank, all results checked, and this process's memory stable from the first to
//! the last quarter.

use anyhow::{ensure, Result};
use kolo::{Kolo, ReduceOp, Tensor};

use crate::util::Rng;

const OPS: usize = 20_000;
const BATCH: usize = 100;

/// Resident set size in bytes (Linux).
fn rss() -> Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().nth(1).unwrap_or("0").parse()?;
    Ok(pages * 4096)
}

pub(crate) fn soak(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let start = std::time::Instant::now();
    let mut order_rng = Rng::new(rank as u64 * 7919 + 1);
    let mut samples = Vec::new();
    for batch in 0..OPS / BATCH {
        // The sizes and kinds are the same on every rank (shared seed); the order differs.
        let mut size_rng = Rng::new(batch as u64);
        let specs: Vec<(usize, usize)> = (0..BATCH)
            .map(|i| (i, 1 + size_rng.int(0, 5000) as usize))
            .collect();
        let mut order: Vec<usize> = (0..BATCH).collect();
        order_rng.shuffle(&mut order);
        let mut handles = Vec::with_capacity(BATCH);
        for &i in &order {
            let (_, n) = specs[i];
            // Names repeat every 10 batches, so the response cache sees both hits and misses.
            let name = format!("soak.{}.{i}", batch % 10);
            let h = match i % 4 {
                0 | 1 => {
                    let t = Tensor::from_vec(vec![(rank + i) as f32; n], &[n])?;
                    k.allreduce(name, t).op(ReduceOp::Sum).submit()?
                }
                2 => {
                    let t = Tensor::from_vec(vec![rank as i64; n], &[n])?;
                    k.allgather(name, t).submit()?
                }
                _ => {
                    let t = Tensor::from_vec(vec![rank as f64 + batch as f64; n], &[n])?;
                    k.broadcast(name, t, batch % size).submit()?
                }
            };
            handles.push((i, n, h));
        }
        for (i, n, h) in handles {
            let out = h.wait()?;
            match i % 4 {
                0 | 1 => {
                    let want = (0..size).map(|r| (r + i) as f32).sum::<f32>();
                    ensure!(
                        out.as_slice::<f32>()?.iter().all(|&x| x == want) && out.len() == n,
                        "batch {batch} op {i}"
                    );
                }
                2 => {
                    let v = out.as_slice::<i64>()?;
                    ensure!(
                        v.len() == n * size,
                        "batch {batch} op {i}: length {}",
                        v.len()
                    );
                    ensure!(
                        (0..size).all(|r| v[r * n..(r + 1) * n].iter().all(|&x| x == r as i64)),
                        "batch {batch} op {i}"
                    );
                }
                _ => {
                    let root = (batch % size) as f64;
                    ensure!(
                        out.as_slice::<f64>()?
                            .iter()
                            .all(|&x| x == root + batch as f64),
                        "batch {batch} op {i}"
                    );
                }
            }
        }
        samples.push(rss()?);
    }
    let q = samples.len() / 4;
    let first = samples[..q].iter().copied().max().unwrap_or(0);
    let last = samples[samples.len() - q..]
        .iter()
        .copied()
        .max()
        .unwrap_or(0);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "soak rank {rank}: {OPS} ops in {secs:.2} s ({:.0} ops/s); RSS first quarter {:.1} MiB, last quarter {:.1} MiB",
        OPS as f64 / secs,
        first as f64 / 1048576.0,
        last as f64 / 1048576.0
    );
    // Allocator noise is allowed; steady growth is not.
    ensure!(
        last <= first + first / 10 + (4 << 20),
        "memory grew from {first} to {last} bytes"
    );
    Ok(())
}
