//! The unit as a Burn module: its blocks visited and mapped under the wrapped
//! module's paths; making the blocks from a module (and the one-element skeleton
//! left behind), and putting whole parameters back into the skeleton.

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Shape, Tensor, TensorData};
use kolo::Kolo;

use super::{record, Full, FullyShard};
use crate::convert;
use crate::error::Error;
use crate::layout::trains;
use crate::sharded::range_of;
use crate::sharded::shard::{Piece, Shard};

/// Takes this rank's block of each float parameter and leaves a one-element
/// placeholder in the module.
pub(super) struct Take {
    pub(super) path: Vec<String>,
    pub(super) size: usize,
    pub(super) rank: usize,
    pub(super) pieces: Vec<Piece>,
    pub(super) params: Vec<Full>,
    pub(super) error: Option<Error>,
}

impl ModuleMapper for Take {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let trainable = trains(&param);
        let (id, t, mapper) = param.consume();
        let device = t.device();
        let full = Full {
            dims: t.dims().to_vec(),
            dtype: t.dtype(),
        };
        if let Err(e) = convert::kolo_dtype(&self.path.join("."), full.dtype) {
            self.error.get_or_insert(e);
        }
        let n = full.numel();
        let range = range_of(n, self.size, self.rank);
        // A copy of the block alone (a slice would keep the whole buffer alive).
        let data: TensorData = t.clone().inner().reshape([n]).slice(range).into_data();
        let block = Tensor::<1>::from_data(data, (&device, full.dtype));
        let block = if device.is_autodiff() {
            block.set_require_grad(trainable)
        } else {
            block
        };
        let mut piece = Param::initialized(id, block);
        if !trainable {
            piece = piece.set_require_grad(false);
        }
        self.pieces.push(Piece {
            path: self.path.clone(),
            param: piece,
        });
        self.params.push(full.clone());
        let placeholder = Tensor::<D>::zeros([1; D], (&device, full.dtype));
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts whole parameters into the skeleton, in module order, under the blocks' ids.
pub(super) struct Fill<'a> {
    pub(super) whole: std::vec::IntoIter<Tensor<1>>,
    pub(super) params: &'a [Full],
    pub(super) ids: Vec<ParamId>,
    pub(super) next: usize,
}

impl ModuleMapper for Fill<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let (Some(flat), Some(full)) = (self.whole.next(), self.params.get(i)) else {
            return param;
        };
        let id = self.ids.get(i).copied().unwrap_or(param.id);
        let (_, _, mapper) = param.consume();
        Param::from_mapped_value(id, reshaped::<D>(flat, &full.dims), mapper)
    }
}

/// Whether `model` holds blocks of [`FullyShard`] units (made in this process).
pub(crate) fn has_units<M: Module>(kolo: &Kolo, model: &M) -> bool {
    struct Find {
        size: usize,
        rank: usize,
        found: bool,
    }
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dims = param.lazy_shape().to_vec();
            self.found |= record::block_of(param.id, &dims, self.size, self.rank).is_some();
        }
    }
    let mut f = Find {
        size: kolo.size(),
        rank: kolo.rank(),
        found: false,
    };
    model.visit(&mut f);
    f.found
}

/// Bytes of this rank's float parameters in `model` (a model of
/// [`FullyShard`] units holds 1/N of each unit's parameters): what
/// `train_big_mlp` reports beside the optimizer state.
pub fn local_param_bytes<M: Module>(model: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0 += t.shape().num_elements() * t.dtype().size();
        }
    }
    let mut c = Count(0);
    model.visit(&mut c);
    c.0
}

impl<M: Module> Module for FullyShard<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.shard.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.with_shard(|s| s.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.with_shard(|s| s.to_device(device))
    }

    fn train(self) -> Self {
        self.with_shard(Module::train)
    }

    fn valid(&self) -> Self {
        self.clone().with_shard(|s| s.valid())
    }

    fn materialize(self) -> Self {
        self.with_shard(Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.shard.visit(visitor);
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        self.with_shard(|s| s.map(mapper))
    }
}

impl<M: Module> FullyShard<M> {
    fn with_shard(self, f: impl FnOnce(Shard) -> Shard) -> Self {
        let shard = f(self.shard);
        // A mapping may give the blocks other ids (a record loaded with its own).
        for (p, full) in shard.pieces.iter().zip(&self.unit.params) {
            record::register(p.param.id, full.clone());
        }
        let generation = self.unit.ahead.renew(&shard);
        FullyShard {
            shard,
            generation,
            unit: self.unit,
            settings: self.settings,
        }
    }
}

/// `t` on `device`: a collective's output can come back in the memory of the tensor
/// lent to it (a block of a unit offloaded elsewhere, at np 1).
pub(crate) fn on(t: Tensor<1>, device: &Device) -> Tensor<1> {
    if t.device() == *device {
        t
    } else {
        t.to_device(device)
    }
}

/// `flat` reshaped to `dims` (a parameter's whole shape).
pub(crate) fn reshaped<const D: usize>(flat: Tensor<1>, dims: &[usize]) -> Tensor<D> {
    flat.reshape(Shape::from(dims.to_vec()))
}

impl<M: Module> burn::module::ModuleDisplayDefault for FullyShard<M> {
    fn content(&self, content: burn::module::Content) -> Option<burn::module::Content> {
        let shapes: Vec<&[usize]> = self.unit.params.iter().map(|p| &p.dims[..]).collect();
        content
            .add_single(&format!(
                "FullyShard {{unit: {}, parameters: {shapes:?}}}",
                self.unit.name
            ))
            .optional()
    }

    fn num_params(&self) -> usize {
        self.unit.params.iter().map(Full::numel).sum()
    }
}

impl<M: Module> burn::module::ModuleDisplay for FullyShard<M> {}
