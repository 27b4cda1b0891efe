//! Data-parallel linear regression with a hand-written SGD on plain `Vec<f32>`: nothing
//! in kolo's optimizer needs a framework. Each rank fits its own shard of a synthetic
//! dataset; gradients are averaged across ranks before every step, so all ranks hold
//! the same weights. Run with `mpirun -np 2 target/release/examples/plain_sgd`.

use kolo::{DType, DistributedOptimizer, GradientStep, Gradients, Tensor};

/// y = 3·x0 − 2·x1 + 0.5
const TRUE_W: [f32; 2] = [3.0, -2.0];
const TRUE_B: f32 = 0.5;

struct Sgd {
    w: Vec<f32>,
    b: Vec<f32>,
    lr: f32,
}

impl GradientStep for Sgd {
    fn step(&mut self, g: &Gradients) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        for (w, g) in self.w.iter_mut().zip(g["w"].as_slice::<f32>()?) {
            *w -= self.lr * g;
        }
        for (b, g) in self.b.iter_mut().zip(g["b"].as_slice::<f32>()?) {
            *b -= self.lr * g;
        }
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    // Each rank starts from different weights; broadcast makes them rank 0's.
    let mut start = std::collections::BTreeMap::from([
        (
            "w".to_string(),
            Tensor::from_vec(vec![rank as f32; 2], &[2])?,
        ),
        (
            "b".to_string(),
            Tensor::from_vec(vec![-(rank as f32)], &[1])?,
        ),
    ]);
    kolo::broadcast_parameters(&kolo, &mut start, 0)?;
    let sgd = Sgd {
        w: start["w"].as_slice::<f32>()?.to_vec(),
        b: start["b"].as_slice::<f32>()?.to_vec(),
        lr: 0.1,
    };
    let mut opt = DistributedOptimizer::builder(kolo.clone(), sgd)
        .param("w", &[2], DType::F32)
        .param("b", &[1], DType::F32)
        .build()?;

    // This rank's shard: points i ≡ rank (mod size) of a fixed grid.
    let xs: Vec<[f32; 2]> = (0..256)
        .filter(|i| i % size == rank)
        .map(|i| [(i % 16) as f32 / 8.0 - 1.0, (i / 16) as f32 / 8.0 - 1.0])
        .collect();
    for epoch in 0..200 {
        let (w, b) = (&opt.inner().w, opt.inner().b[0]);
        let mut gw = [0.0f32; 2];
        let mut gb = 0.0f32;
        let mut loss = 0.0f32;
        for x in &xs {
            let y = TRUE_W[0] * x[0] + TRUE_W[1] * x[1] + TRUE_B;
            let err = w[0] * x[0] + w[1] * x[1] + b - y;
            loss += err * err / xs.len() as f32;
            gw[0] += 2.0 * err * x[0] / xs.len() as f32;
            gw[1] += 2.0 * err * x[1] / xs.len() as f32;
            gb += 2.0 * err / xs.len() as f32;
        }
        opt.submit_gradient("w", Tensor::from_vec(gw.to_vec(), &[2])?)?;
        opt.submit_gradient("b", Tensor::from_vec(vec![gb], &[1])?)?;
        opt.step()?;
        let avg_loss = kolo
            .allreduce("loss", Tensor::from_vec(vec![loss], &[1])?)
            .wait()?;
        if rank == 0 && epoch % 50 == 49 {
            println!(
                "epoch {:3}: mean loss over {size} ranks {:.6}",
                epoch + 1,
                avg_loss.as_slice::<f32>()?[0]
            );
        }
    }
    let all = kolo.allgather_object("final", (opt.inner().w.clone(), opt.inner().b[0]))?;
    if rank == 0 {
        println!(
            "rank 0 fitted w = {:?}, b = {:.4} (true {TRUE_W:?}, {TRUE_B})",
            all[0].0, all[0].1
        );
        let same = all.iter().all(|p| p == &all[0]);
        println!("all {size} ranks hold identical weights: {same}");
    }
    kolo.shutdown()?;
    Ok(())
}
