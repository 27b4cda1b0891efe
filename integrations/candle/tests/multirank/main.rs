//! Multi-rank tests of kolo-candle: this binary launches itself under `mpirun -np N`
//! once per case (see the core crate's `tests/collectives` for the pattern).

#[path = "../../../../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;
mod issue53;
mod issue57;

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{linear, AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use harness::Case;
use kolo::{Kolo, ReduceOp};
use kolo_candle::{broadcast_parameters, DistributedOptimizer, Error};
use libtest_mimic::{Arguments, Trial};

/// 8 inputs, `hidden` units, 4 classes.
struct Small {
    fc1: Linear,
    fc2: Linear,
}

impl Small {
    fn new(hidden: usize, varmap: &VarMap) -> candle_core::Result<Self> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        Ok(Small {
            fc1: linear(8, hidden, vb.pp("fc1"))?,
            fc2: linear(hidden, 4, vb.pp("fc2"))?,
        })
    }

    fn loss(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
        let logits = self.fc2.forward(&self.fc1.forward(x)?.relu()?)?;
        candle_nn::loss::cross_entropy(&logits, y)
    }
}

/// Samples `ids` of a fixed synthetic dataset (8 features, 4 classes).
fn samples(ids: std::ops::Range<usize>) -> candle_core::Result<(Tensor, Tensor)> {
    let n = ids.len();
    let mut x = Vec::with_capacity(n * 8);
    let mut y = Vec::with_capacity(n);
    for i in ids {
        for j in 0..8 {
            x.push((((i * 31 + j * 17) % 23) as f32 - 11.0) / 7.0);
        }
        y.push(((i * 7 + i / 3) % 4) as u32);
    }
    Ok((
        Tensor::from_vec(x, (n, 8), &Device::Cpu)?,
        Tensor::from_vec(y, n, &Device::Cpu)?,
    ))
}

/// Every variable's values by name (f32 variables).
fn values(varmap: &VarMap) -> Result<HashMap<String, Vec<f32>>> {
    values_f32(varmap)
}

/// Sets `to`'s variables to `from`'s values, by name.
fn copy_values(from: &VarMap, to: &VarMap) -> Result<()> {
    let from = from
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let to = to.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    for (name, v) in from.iter() {
        to.get(name).context("same names")?.set(v.as_tensor())?;
    }
    Ok(())
}

/// The largest difference between two sets of values.
fn max_diff(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) -> Result<f32> {
    ensure!(
        a.len() == b.len(),
        "{} variables against {}",
        a.len(),
        b.len()
    );
    let mut worst = 0f32;
    for (name, va) in a {
        let vb = b.get(name).with_context(|| format!("no {name}"))?;
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs());
        }
    }
    Ok(worst)
}

const STEPS: usize = 20;
/// Samples per rank per step.
const PER_RANK: usize = 4;

/// 20 steps on every rank against one process on the combined batch (every rank
/// computes that reference itself): the same parameters to 1e-5. With `passes` > 1
/// each rank's share of a step comes in that many micro-batches. `scale` multiplies
/// the reference's learning rate (N for `ReduceOp::Sum`).
fn equivalence<O: Optimizer>(
    kolo: &Kolo,
    make: impl Fn(Vec<Var>, f64) -> candle_core::Result<O>,
    passes: usize,
    op: ReduceOp,
) -> Result<()> {
    let (rank, n) = (kolo.rank(), kolo.size());
    let b = PER_RANK * passes;
    let varmap = VarMap::new();
    let model = Small::new(16, &varmap)?;
    broadcast_parameters(kolo, &varmap, 0)?;
    let initial = values(&varmap)?;
    let refmap = VarMap::new();
    let reference = Small::new(16, &refmap)?;
    copy_values(&varmap, &refmap)?;
    let scale = if op == ReduceOp::Sum { n as f64 } else { 1.0 };
    let mut opt =
        DistributedOptimizer::new(kolo, make(varmap.all_vars(), 1.0)?, varmap.all_vars())?
            .op(op)?
            .backward_passes_per_step(passes)?;
    let mut ref_opt = make(refmap.all_vars(), scale)?;
    for step in 0..STEPS {
        let first = step * n * b;
        ref_opt.backward_step(&reference.loss(&samples(first..first + n * b)?)?)?;
        let mine = first + rank * b;
        for p in 0..passes {
            let lo = mine + p * PER_RANK;
            opt.backward_step(&model.loss(&samples(lo..lo + PER_RANK)?)?)?;
        }
    }
    let (got, want) = (values(&varmap)?, values(&refmap)?);
    let diff = max_diff(&got, &want)?;
    ensure!(
        diff <= 1e-5,
        "rank {rank}: parameters differ from one process's by {diff}"
    );
    // They also moved: the test is not passing on untouched weights.
    let moved = max_diff(&got, &initial)?;
    ensure!(
        moved > 1e-3,
        "rank {rank}: training moved the parameters by {moved} only"
    );
    let all: Vec<Vec<f32>> = kolo.allgather_object("params", {
        let mut v: Vec<(String, Vec<f32>)> = got.into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.into_iter().flat_map(|(_, x)| x).collect::<Vec<f32>>()
    })?;
    ensure!(
        all.windows(2).all(|w| w[0] == w[1]),
        "the ranks' parameters differ"
    );
    Ok(())
}

fn sgd(vars: Vec<Var>, scale: f64) -> candle_core::Result<SGD> {
    SGD::new(vars, 0.1 * scale)
}

fn adamw(vars: Vec<Var>, scale: f64) -> candle_core::Result<AdamW> {
    AdamW::new(
        vars,
        ParamsAdamW {
            lr: 0.01 * scale,
            ..ParamsAdamW::default()
        },
    )
}

fn equivalence_sgd(kolo: &Kolo) -> Result<()> {
    equivalence(kolo, sgd, 1, ReduceOp::Average)
}

fn equivalence_adamw(kolo: &Kolo) -> Result<()> {
    equivalence(kolo, adamw, 1, ReduceOp::Average)
}

fn equivalence_sgd_accumulated(kolo: &Kolo) -> Result<()> {
    equivalence(kolo, sgd, 3, ReduceOp::Average)
}

fn equivalence_adamw_accumulated(kolo: &Kolo) -> Result<()> {
    equivalence(kolo, adamw, 2, ReduceOp::Average)
}

fn equivalence_sgd_sum(kolo: &Kolo) -> Result<()> {
    equivalence(kolo, sgd, 1, ReduceOp::Sum)
}

/// The error's text on this rank, or why there was none.
fn err_text<T>(r: std::result::Result<T, Error>) -> String {
    match r {
        Ok(_) => "no error".into(),
        Err(e) => e.to_string(),
    }
}

/// Rank 1 builds a wider model: `DistributedOptimizer::new` and
/// `broadcast_parameters` fail on every rank, naming the first differing variable and
/// the ranks; afterwards the job goes on.
fn var_mismatch(kolo: &Kolo) -> Result<()> {
    let (rank, n) = (kolo.rank(), kolo.size());
    let varmap = VarMap::new();
    let hidden = if rank == 1 { 17 } else { 16 };
    let _model = Small::new(hidden, &varmap)?;
    let others: Vec<String> = (0..n).filter(|&r| r != 1).map(|r| r.to_string()).collect();
    let (who, hold) = if others.len() == 1 {
        ("rank", "holds")
    } else {
        ("ranks", "hold")
    };
    let others = others.join(", ");

    let got = err_text(DistributedOptimizer::new(
        kolo,
        SGD::new(varmap.all_vars(), 0.1)?,
        varmap.all_vars(),
    ));
    let want = format!(
        "kolo_candle::DistributedOptimizer: the ranks' variables differ: variable #0 in creation order: {who} {others} {hold} [16, 8] f32; rank 1 holds [17, 8] f32"
    );
    ensure!(got == want, "rank {rank}: got {got:?}, want {want:?}");

    let got = err_text(broadcast_parameters(kolo, &varmap, 0));
    let want = format!(
        "kolo_candle::broadcast_parameters: the ranks' variables differ: variable \"fc1.bias\": {who} {others} {hold} \"fc1.bias\" [16] f32; rank 1 holds \"fc1.bias\" [17] f32"
    );
    ensure!(got == want, "rank {rank}: got {got:?}, want {want:?}");

    // A rank with one variable fewer.
    let fewer = VarMap::new();
    let vb = VarBuilder::from_varmap(&fewer, DType::F32, &Device::Cpu);
    let _a = vb.get((2, 2), "a")?;
    if rank != 1 {
        let _b = vb.get(3, "b")?;
    }
    let got = err_text(DistributedOptimizer::new(
        kolo,
        SGD::new(fewer.all_vars(), 0.1)?,
        fewer.all_vars(),
    ));
    ensure!(
        got.contains("variable #1 in creation order:")
            && got.contains("rank 1 holds no such variable (it has 1)"),
        "rank {rank}: got {got:?}"
    );

    // A root that is no rank: refused before any exchange, on every rank alike.
    let got = err_text(broadcast_parameters(kolo, &varmap, n));
    ensure!(
        got.contains(&format!("root {n} is not a rank")),
        "rank {rank}: got {got:?}"
    );

    // The job goes on.
    let sum = kolo
        .allreduce("after", kolo::Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(sum == vec![n as f32], "rank {rank}: sum {sum:?}");
    Ok(())
}

/// Every rank draws its own weights; after the broadcast from the last rank all hold
/// that rank's, in every dtype kolo carries.
fn broadcast_from_root(kolo: &Kolo) -> Result<()> {
    let (rank, n) = (kolo.rank(), kolo.size());
    let root = n - 1;
    let varmap = VarMap::new();
    let _model = Small::new(16, &varmap)?;
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
    let _d = vb.get_with_hints(5, "double", candle_nn::Init::Const(rank as f64))?;
    let vb = VarBuilder::from_varmap(&varmap, DType::BF16, &Device::Cpu);
    let _h = vb.get_with_hints(3, "half", candle_nn::Init::Const(rank as f64 + 0.5))?;
    let mine: Vec<Vec<f32>> = {
        let mut v: Vec<(String, Vec<f32>)> = values_f32(&varmap)?.into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.into_iter().map(|(_, x)| x).collect()
    };
    let before: Vec<Vec<Vec<f32>>> = kolo.allgather_object("before", mine)?;
    ensure!(
        before[0] != before[root],
        "the ranks drew the same weights: the test shows nothing"
    );
    broadcast_parameters(kolo, &varmap, root)?;
    let mut after: Vec<(String, Vec<f32>)> = values_f32(&varmap)?.into_iter().collect();
    after.sort_by(|a, b| a.0.cmp(&b.0));
    let after: Vec<Vec<f32>> = after.into_iter().map(|(_, x)| x).collect();
    ensure!(
        after == before[root],
        "rank {rank}: not the root's weights after the broadcast"
    );
    Ok(())
}

/// Every variable's values as f32, by name (any float dtype).
fn values_f32(varmap: &VarMap) -> Result<HashMap<String, Vec<f32>>> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let mut out = HashMap::new();
    for (name, v) in data.iter() {
        let t = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
        out.insert(name.clone(), t.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// A variable only rank 0's loss uses: the others contribute zeros, so the averaged
/// gradient is rank 0's divided by the ranks, and every rank steps it alike.
fn unused_variable(kolo: &Kolo) -> Result<()> {
    let (rank, n) = (kolo.rank(), kolo.size());
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let w = vb.get_with_hints(4, "w", candle_nn::Init::Const(1.0))?;
    let u = vb.get_with_hints(2, "u", candle_nn::Init::Const(1.0))?;
    let mut opt =
        DistributedOptimizer::new(kolo, SGD::new(varmap.all_vars(), 1.0)?, varmap.all_vars())?;
    // loss = sum(w) (+ sum(u) on rank 0): d/dw = 1 everywhere, d/du = 1 on rank 0 only.
    let mut loss = w.sum_all()?;
    if rank == 0 {
        loss = (loss + u.sum_all()?)?;
    }
    opt.backward_step(&loss)?;
    let v = values(&varmap)?;
    ensure!(v["w"] == vec![0.0; 4], "rank {rank}: w {:?}", v["w"]);
    let want = 1.0 - 1.0 / n as f32;
    ensure!(
        v["u"].iter().all(|x| (x - want).abs() < 1e-6),
        "rank {rank}: u {:?}, want {want}",
        v["u"]
    );
    ensure!(
        err_text(
            DistributedOptimizer::new(kolo, SGD::new(vec![], 1.0)?, vec![])?.op(ReduceOp::Max)
        )
        .contains("Max is not a way to combine gradients"),
        "Max accepted"
    );
    Ok(())
}

const CASES: &[(&str, Case, &[usize])] = &[
    ("equivalence_sgd", equivalence_sgd, &[1, 2, 4]),
    ("issue57_reduce", issue57::reduce, &[1, 2, 3, 4]),
    ("issue57_decentralized", issue57::decentralized, &[1, 2, 4]),
    ("issue57_disagreement", issue57::disagreement, &[2, 3]),
    (
        "issue57_weight_exchanges",
        issue57::weight_exchanges,
        &[2, 3, 4],
    ),
    ("issue57_onebit_adam", issue57::onebit_adam, &[1, 2, 4]),
    ("equivalence_adamw", equivalence_adamw, &[2, 4]),
    (
        "equivalence_sgd_accumulated",
        equivalence_sgd_accumulated,
        &[2, 3],
    ),
    (
        "equivalence_adamw_accumulated",
        equivalence_adamw_accumulated,
        &[2, 4],
    ),
    ("equivalence_sgd_sum", equivalence_sgd_sum, &[2, 3]),
    ("var_mismatch", var_mismatch, &[2, 3]),
    ("broadcast_from_root", broadcast_from_root, &[2, 3]),
    ("unused_variable", unused_variable, &[2, 3]),
    ("issue53_unused_head", issue53::unused_head, &[2, 4]),
    ("issue53_pairs_by_name", issue53::pairs_by_name, &[2, 3]),
    (
        "issue53_local_error_mid_submission",
        issue53::local_error_mid_submission,
        &[2, 3],
    ),
];

/// The digits example's runs: name, arguments, rank counts.
const EXAMPLES: &[(&str, &[&str], &[usize])] = &[
    (
        "digits_candle",
        &["--epochs", "10", "--min-accuracy", "0.95"],
        &[2, 4],
    ),
    (
        "digits_candle_sgd_accumulated",
        &[
            "--epochs",
            "15",
            "--sgd",
            "--lr",
            "0.2",
            "--batch-size",
            "16",
            "--backward-passes-per-step",
            "2",
            "--min-accuracy",
            "0.95",
        ],
        &[2],
    ),
    // Issue 57: each synchronisation algorithm reaches 95% at 4 ranks.
    (
        "digits_candle_bytegrad",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "bytegrad",
            "--compress-on-one-host",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_adasum",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "adasum",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_decentralized",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "decentralized",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_decentralized_8bit",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "decentralized-8bit",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_async",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "async",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_onebit_adam",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "onebit-adam",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
    (
        "digits_candle_qadam",
        &[
            "--epochs",
            "10",
            "--algorithm",
            "qadam",
            "--min-accuracy",
            "0.95",
        ],
        &[4],
    ),
];

/// The sibling of this test binary's directory: `target/release/<name>`.
fn built(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.join(name)).filter(|p| p.exists())
}

/// Runs the digits example under `kolorun -np np` the way the README does (each rank
/// of this test binary becomes the example, see [`exec_example`]); passes when every
/// rank exits 0 (the example checks `--min-accuracy` itself) within 5 minutes.
fn example_trial(name: &'static str, np: usize) -> Trial {
    Trial::test(format!("{name}/np{np}"), move || {
        let kolorun = built("kolorun")
            .ok_or("target/release/kolorun is missing: cargo build --release -p kolorun")?;
        let mut cmd = std::process::Command::new(kolorun);
        cmd.args(["-np", &np.to_string()]);
        harness::mpi_env(&mut cmd);
        let run = harness::launch(
            cmd,
            name,
            Duration::from_secs(300),
            &[("RAYON_NUM_THREADS", "1")],
            false,
        )?;
        run.succeeded(&format!("{name} at np {np}"))?;
        if !run.output.contains("final test accuracy") {
            return Err(format!(
                "{name} at np {np} printed no final accuracy:\n{}",
                run.output
            )
            .into());
        }
        Ok(())
    })
}

/// Worker side of an example case: becomes the example binary (built beside this test
/// by `cargo test`) before MPI starts here, so that it is this rank.
fn exec_example(args: &[&str]) -> ! {
    use std::os::unix::process::CommandExt;
    let Some(example) = built("examples/train_digits_candle") else {
        eprintln!(
            "target/release/examples/train_digits_candle is missing: \
             cargo build --release -p kolo-candle --examples"
        );
        std::process::exit(2);
    };
    let err = std::process::Command::new(&example).args(args).exec();
    eprintln!("cannot run {}: {err}", example.display());
    std::process::exit(2);
}

fn main() {
    if let Ok(case) = std::env::var("KOLO_TEST_CASE") {
        if let Some((_, args, _)) = EXAMPLES.iter().find(|(n, _, _)| *n == case) {
            exec_example(args);
        }
        let cases: Vec<(&str, Case)> = CASES.iter().map(|(n, f, _)| (*n, *f)).collect();
        harness::run_worker(&case, &cases);
    }
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for &(name, _, nps) in CASES {
        for &np in nps {
            trials.push(harness::trial(
                name,
                np,
                Duration::from_secs(120),
                &[("RAYON_NUM_THREADS", "1")],
            ));
        }
    }
    for &(name, _, nps) in EXAMPLES {
        for &np in nps {
            trials.push(example_trial(name, np));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
