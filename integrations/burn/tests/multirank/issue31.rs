//! Regression tests of issue 31 (kolo-burn items): a failure on one rank fails every
//! rank instead of leaving the others waiting, and `DistributedOptimizer`'s names stay
//! unique across a resume.

use anyhow::{bail, ensure, Context, Result};
use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{
    AdamConfig, GradientsParams, LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink,
    StateSource,
};
use burn::tensor::quantization::QuantScheme;
use burn::tensor::{Device, Tensor, TensorData};
use kolo::Kolo;
use kolo_burn::{
    broadcast_optimizer_state, broadcast_parameters, DistributedOptimizer, GradientReducer,
};

use crate::{grads_for, params, samples, Small};

/// A layer visited twice under the same name: Burn's record writer refuses the
/// duplicate tensor names, so `into_record().into_bytes()` fails.
#[derive(Clone, Debug)]
struct Twice(Linear);

impl Module for Twice {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.0.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        Twice(self.0.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        Twice(self.0.to_device(device))
    }

    fn train(self) -> Self {
        Twice(self.0.train())
    }

    fn valid(&self) -> Self {
        Twice(self.0.valid())
    }

    fn materialize(self) -> Self {
        Twice(self.0.materialize())
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        for _ in 0..2 {
            visitor.enter_module("twin", "Linear");
            self.0.visit(visitor);
            visitor.exit_module("twin", "Linear");
        }
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        Twice(self.0.map(mapper))
    }
}

/// An optimizer whose state Burn cannot serialise (it writes one name twice); its step
/// leaves the parameter as it is.
#[derive(Clone, Debug)]
struct Unsavable;

#[derive(Clone, Debug)]
struct UnsavableState;

impl RecordState for UnsavableState {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        for _ in 0..2 {
            out.push_tensor(prefix, "same", TensorData::new(vec![0.0f32], [1]));
        }
    }

    fn state_unflatten(_: &str, _: &mut StateSource, _: &Device) -> Option<Self> {
        Some(UnsavableState)
    }
}

impl Optimizer for Unsavable {
    type State<const D: usize> = UnsavableState;

    fn step<const D: usize>(
        &self,
        _: LearningRate,
        tensor: Tensor<D>,
        _: Tensor<D>,
        _: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        (tensor, Some(UnsavableState))
    }

    fn to_device<const D: usize>(state: Self::State<D>, _: &Device) -> Self::State<D> {
        state
    }
}

/// `result` failed on every rank: on `failing` with its own error containing `own`,
/// elsewhere with an error naming `failing`, `other` and the cause `cause`.
fn failed_everywhere<T>(
    k: &Kolo,
    what: &str,
    result: kolo_burn::Result<T>,
    failing: usize,
    own: &str,
    other: &str,
    cause: &str,
) -> Result<()> {
    let err = match result {
        Ok(_) => bail!("{what} succeeded on rank {}", k.rank()),
        Err(e) => e.to_string(),
    };
    let wanted = if k.rank() == failing {
        vec![own.to_string(), cause.to_string()]
    } else {
        vec![
            format!("rank {failing} could not {other}"),
            cause.to_string(),
        ]
    };
    for want in wanted {
        ensure!(err.contains(&want), "{what}: {err:?} lacks {want:?}");
    }
    Ok(())
}

/// Every rank holds bit-identical parameters.
fn identical(k: &Kolo, name: &str, model: &Small) -> Result<()> {
    let bits: Vec<u32> = params(model).iter().map(|x| x.to_bits()).collect();
    let all: Vec<Vec<u32>> = k.allgather_object(name, bits)?;
    ensure!(
        all.iter().all(|p| p == &all[0]),
        "{name}: the ranks' parameters differ"
    );
    Ok(())
}

/// Item 2: the root of `broadcast_parameters` / `broadcast_optimizer_state` cannot
/// serialise; every rank fails (the others naming the root and Burn's message) instead
/// of waiting for the broadcast, and the ranks are still in step afterwards.
pub(crate) fn broadcast_root_failure(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let root = k.size() - 1;
    let twice = Twice(LinearConfig::new(4, 2).init(&device));
    failed_everywhere(
        k,
        "broadcast_parameters",
        broadcast_parameters(k, twice, root),
        root,
        "serialising the module: ",
        "serialise the module for broadcast_parameters: ",
        "Duplicate tensor name 'twin.weight'",
    )?;

    let model = broadcast_parameters(k, Small::new(&device), 0)?;
    let mut optim: ModuleOptimizer = Unsavable.into();
    let grads = grads_for(&model, 0..4, &device);
    let model = optim.step(0.1, model, grads);
    failed_everywhere(
        k,
        "broadcast_optimizer_state",
        broadcast_optimizer_state(k, optim, root),
        root,
        "serialising the optimizer state: ",
        "serialise the optimizer state for broadcast_optimizer_state: ",
        "Duplicate tensor name",
    )?;

    let model = broadcast_parameters(k, model, root)?;
    identical(k, "after_failed_broadcasts", &model)
}

/// Item 4: a gradient one rank cannot hand to the reduction (here a quantized one,
/// which kolo cannot reduce) fails `reduce` on every rank, naming that rank and the
/// cause, instead of leaving the others waiting for its buckets; so does a layer that
/// is not part of the model given to `Overlap::layer` on one rank. Afterwards the
/// ranks are still in step: the next steps reduce, and the models agree.
pub(crate) fn rank_local_failure(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let mut model = broadcast_parameters(k, Small::new(&device), 0)?;
    let mut optim: ModuleOptimizer = AdamConfig::new().init();
    let bad = k.size() - 1;
    // Buckets smaller than the model: the failing gradient is in one of several.
    let reducer = GradientReducer::new(k).chunk_bytes(300);

    let mut grads = grads_for(&model, 0..4, &device);
    if k.rank() == bad {
        let id = model.fc1.weight.id;
        let g: Tensor<2> = grads.remove(id).context("fc1.weight has a gradient")?;
        grads.register(id, g.quantize_dynamic(&QuantScheme::default()));
    }
    failed_everywhere(
        k,
        "reduce",
        reducer.reduce(&model, grads),
        bad,
        "reading gradient \"fc1.weight\": gradients of dtype QFloat",
        "hand its gradients to the reduction",
        "cannot be reduced (float dtypes only)",
    )?;
    let grads = reducer.reduce(&model, grads_for(&model, 4..8, &device))?;
    model = optim.step(0.05, model, grads);
    identical(k, "after_failed_reduce", &model)?;

    // The overlapped path: rank `bad` passes a stranger layer to `Overlap::layer`.
    let sync = reducer.overlap(&model)?;
    let (x, y) = samples(8..12, &device);
    let h = if k.rank() == bad {
        let stranger = LinearConfig::new(8, 16).init(&device);
        let _ = sync.layer(&stranger, &x);
        model.fc1.forward(x)
    } else {
        sync.layer(&model.fc1, &x).forward(x)
    };
    let h = model.act.forward(h);
    let out = sync.layer(&model.fc2, &h).forward(h);
    let loss = CrossEntropyLossConfig::new().init(&device).forward(out, y);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    failed_everywhere(
        k,
        "Overlap::finish",
        sync.finish(&model, grads),
        bad,
        "Overlap::layer: parameter",
        "hand its gradients to the reduction",
        "is not part of the model given to GradientReducer::overlap",
    )?;
    let sync = reducer.overlap(&model)?;
    let (x, y) = samples(12..16, &device);
    let h = model.act.forward(sync.layer(&model.fc1, &x).forward(x));
    let out = sync.layer(&model.fc2, &h).forward(h);
    let loss = CrossEntropyLossConfig::new().init(&device).forward(out, y);
    let grads = sync.finish(&model, GradientsParams::from_grads(loss.backward(), &model))?;
    model = optim.step(0.05, model, grads);
    identical(k, "after_failed_overlap", &model)
}

/// Item 10: parameters stepped for the first time after a resume of a
/// `DistributedOptimizer` get names of their own, not the restored parameters' names.
/// Before the resume only fc2 is stepped (positions 0 and 1); after it fc1 comes
/// first in module order. The timeline of the resumed step shows each parameter on
/// its own track, with one shape each.
pub(crate) fn resume_positions(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let mut model = broadcast_parameters(k, Small::new(&device), 0)?;
    let fc1 = (
        model.fc1.weight.id,
        model.fc1.bias.as_ref().context("fc1 has a bias")?.id,
    );
    let mut optim: ModuleOptimizer = DistributedOptimizer::new(k, AdamConfig::new().build()).into();
    for step in 0..2 {
        let mut grads = grads_for(&model, step * 4..step * 4 + 4, &device);
        let _: Option<Tensor<2>> = grads.remove(fc1.0);
        let _: Option<Tensor<1>> = grads.remove(fc1.1);
        model = optim.step(0.05, model, grads);
    }
    let saved = optim.into_bytes()?;

    // A fresh optimizer, as in a new process, resumed from the saved state.
    let resumed: ModuleOptimizer = DistributedOptimizer::new(k, AdamConfig::new().build()).into();
    let mut resumed = resumed.from_bytes(saved)?;
    let trace = std::env::temp_dir().join(format!(
        "kolo-burn-issue31-{}.json",
        std::env::var("OMPI_MCA_orte_ess_jobid").unwrap_or_default()
    ));
    if k.rank() == 0 {
        k.start_timeline(&trace)?;
    }
    let grads = grads_for(&model, 8..12, &device);
    model = resumed.step(0.05, model, grads);
    // Every op of the step is written to the trace before a later collective runs.
    k.barrier()?;
    if k.rank() == 0 {
        k.stop_timeline()?;
        let tracks = param_tracks(&trace);
        let _ = std::fs::remove_file(&trace);
        let tracks = tracks?;
        ensure!(
            tracks.len() == 4 && tracks.iter().all(|(_, shapes)| shapes.len() == 1),
            "the resumed step reduced its 4 parameters under these names and shapes: \
             {tracks:?}"
        );
    }
    identical(k, "after_resume", &model)
}

/// The `kolo_burn.param.*` tracks of a timeline and the shapes reduced on each.
fn param_tracks(
    path: &std::path::Path,
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let events: Vec<serde_json::Value> = serde_json::from_str(&text)?;
    let mut names = std::collections::HashMap::new();
    for e in &events {
        if e["name"] == "thread_name" {
            if let Some(n) = e["args"]["name"].as_str() {
                names.insert(e["tid"].to_string(), n.to_string());
            }
        }
    }
    let mut tracks = std::collections::BTreeMap::<String, std::collections::BTreeSet<_>>::new();
    for e in &events {
        let Some(name) = names.get(&e["tid"].to_string()) else {
            continue;
        };
        if !name.starts_with("kolo_burn.param.") || e["ph"] != "X" {
            continue;
        }
        let shapes = tracks.entry(name.clone()).or_default();
        if !e["args"]["shape"].is_null() {
            shapes.insert(e["args"]["shape"].to_string());
        }
    }
    Ok(tracks)
}
