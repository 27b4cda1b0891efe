//! Plain single-process candle training of the benchmark's MLP: no kolo, no MPI (the
//! binary links neither). The baseline of `benches/candle_mlp.rs`, which launches it
//! alternately with kolo's ranks; a `[[bin]]` target so that Cargo builds it with the
//! benchmark and hands over its path (`CARGO_BIN_EXE_kolo-candle-plain-mlp`).
//!
//! ```sh
//! RAYON_NUM_THREADS=1 target/release/kolo-candle-plain-mlp big 3 20
//! ```

#[path = "../common/mlp.rs"]
mod mlp;

use candle_nn::{Optimizer, VarMap, SGD};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).map_or("small", String::as_str);
    let dims = mlp::dims(model).ok_or_else(|| format!("unknown model {model:?}: small or big"))?;
    let warmup = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(3);
    let steps = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(20);
    let varmap = VarMap::new();
    let net = mlp::Mlp::new(dims, &varmap)?;
    let mut opt = SGD::new(varmap.all_vars(), mlp::LR)?;
    let data = mlp::batch(0, dims, mlp::BATCH)?;
    let rate = mlp::steps_per_s(&net, &mut opt, &data, warmup, steps)?;
    // The line the benchmark reads (kolo's ranks print the same).
    println!("RESULT steps_per_s={rate:.4}");
    Ok(())
}
