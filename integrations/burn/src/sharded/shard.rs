//! The wrapped optimizer's view of this rank's blocks: one 1-D parameter per non-empty
//! block, under **its parameter's id and module path** (issue 53 item 3), so that
//! what a `ModuleOptimizer` decides by id or path — `with_group` (e.g. no weight
//! decay for biases and norms), a per-parameter learning rate, the paths its record
//! keeps to bind groups again after a load — applies to the block as it would to the
//! whole parameter in plain Burn. A derived module would present the blocks as
//! `pieces.0`, `pieces.1`, … (as it did), which no group matches.

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

/// This rank's block of one parameter.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    /// The parameter's module path, by segment (`["fc1", "bias"]`).
    pub(crate) path: Vec<String>,
    /// The block, with the parameter's id.
    pub(crate) param: Param<Tensor<1>>,
}

/// This rank's blocks, as one module.
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    pub(crate) pieces: Vec<Piece>,
}

/// A `Piece`'s path segments from a dotted module path.
pub(crate) fn segments(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

impl Shard {
    fn each(self, f: impl Fn(Param<Tensor<1>>) -> Param<Tensor<1>>) -> Self {
        Shard {
            pieces: self
                .pieces
                .into_iter()
                .map(|p| Piece {
                    path: p.path,
                    param: f(p.param),
                })
                .collect(),
        }
    }
}

impl Module for Shard {
    fn collect_devices(&self, mut devices: Devices) -> Devices {
        for p in &self.pieces {
            devices = p.param.collect_devices(devices);
        }
        devices
    }

    fn fork(self, device: &Device) -> Self {
        self.each(|p| p.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.each(|p| p.to_device(device))
    }

    fn train(self) -> Self {
        self.each(Module::train)
    }

    fn valid(&self) -> Self {
        self.clone().each(|p| p.valid())
    }

    fn materialize(self) -> Self {
        self.each(Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        for p in &self.pieces {
            for s in &p.path {
                visitor.enter_module(s, "Struct");
            }
            p.param.visit(visitor);
            for s in p.path.iter().rev() {
                visitor.exit_module(s, "Struct");
            }
        }
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        Shard {
            pieces: self
                .pieces
                .into_iter()
                .map(|p| {
                    for s in &p.path {
                        mapper.enter_module(s, "Struct");
                    }
                    let param = Module::map(p.param, mapper);
                    for s in p.path.iter().rev() {
                        mapper.exit_module(s, "Struct");
                    }
                    Piece {
                        path: p.path,
                        param,
                    }
                })
                .collect(),
        }
    }
}
