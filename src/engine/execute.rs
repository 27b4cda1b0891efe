//! Runs a negotiated request on this rank: prepares buffers, calls the transport,
//! applies scale factors and hands back the result. The layouts (who sends how much,
//! output shapes, scale factors) are in `layout.rs`, shared with `gpu.rs`.

use std::time::Instant;

use super::fusion::FusionBuffer;
use super::layout::{
    allgather_layout, alltoall_layout, first_tensor, fused_inputs, local_or_zeros, post_factor,
    reducescatter_layout, scale_bytes, take_tensor,
};
use super::negotiate::Ready;
use super::request::{OpKind, RequestMeta, Tensors};
use crate::error::{Error, Result};
use crate::handle::Output;
use crate::tensor::{DType, Tensor};
use crate::transport::Transport;
use crate::vocab::{AlltoallOutput, ReduceOp};
use smallvec::SmallVec;

/// Why a process set's (sorted) ranks cannot make a set among `size` ranks. Checked
/// here, after every rank has asked for the same list, so that every rank fails alike.
fn set_ranks_valid(ranks: &[usize], size: usize) -> std::result::Result<(), String> {
    if ranks.is_empty() {
        return Err("a process set needs at least one rank".into());
    }
    if let Some(r) = ranks.iter().find(|&&r| r >= size) {
        return Err(format!(
            "rank {r} is out of range: there are {size} ranks (0..{size})"
        ));
    }
    if let Some(w) = ranks.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("rank {} is listed twice", w[0]));
    }
    Ok(())
}

/// Runs `ready` with this rank's tensors (`None` on a joined rank, which contributes
/// zeros of the agreed shape).
pub(crate) fn run(
    t: &mut dyn Transport,
    ready: &Ready,
    local: Option<Tensors>,
    buffer: &mut FusionBuffer,
) -> Result<Output> {
    let first = ready.first();
    let mut inputs = local_or_zeros(ready, local, |m| Ok(Tensor::zeros(m.dtype, &m.shape)))?;
    let size = t.topology().size;
    let take = |inputs: &mut Tensors| take_tensor(ready, inputs);
    match ready.kind {
        OpKind::Allreduce => {
            let mut tensor = take(&mut inputs)?;
            allreduce(t, &mut tensor, first, size)?;
            Ok(Output::Tensor(tensor))
        }
        OpKind::GroupedAllreduce => Ok(Output::Tensors(grouped_allreduce(
            t, inputs, first, size, buffer,
        )?)),
        // One rank: the tensor is its own gathering (no copy).
        OpKind::Allgather if size == 1 => Ok(Output::Tensor(take(&mut inputs)?)),
        OpKind::Allgather => Ok(Output::Tensor(allgather(t, &take(&mut inputs)?, ready)?)),
        OpKind::GroupedAllgather => Ok(Output::Tensors(super::grouped::allgather(
            t, inputs, ready, buffer,
        )?)),
        OpKind::GroupedReducescatter => Ok(Output::Tensors(super::grouped::reducescatter(
            t, inputs, ready, buffer,
        )?)),
        OpKind::Broadcast => {
            let mut tensor = take(&mut inputs)?;
            let dtype = tensor.dtype();
            if !tensor.is_empty() {
                t.broadcast(tensor.host_bytes_mut(), first.root, dtype)?;
            }
            Ok(Output::Tensor(tensor))
        }
        OpKind::Alltoall => Ok(Output::Alltoall(alltoall(t, &take(&mut inputs)?, ready)?)),
        OpKind::Reducescatter => Ok(Output::Tensor(reducescatter(
            t,
            take(&mut inputs)?,
            first,
            size,
        )?)),
        OpKind::Barrier => Ok(Output::Unit),
        OpKind::AddProcessSet => {
            let ranks = first.splits.as_deref().unwrap_or_default();
            set_ranks_valid(ranks, size).map_err(|message| Error::InvalidArgument {
                op: "add_process_set",
                name: first.key.to_string(),
                message,
            })?;
            Ok(Output::Detached(Box::new(t.split(ranks)?)))
        }
        // Point to point goes around the cycles (`engine/p2p.rs`).
        OpKind::Join | OpKind::DeviceTurn | OpKind::Send | OpKind::Recv => Err(Error::Internal(
            format!("{} reached the executor", ready.kind.name()),
        )),
    }
}

/// Completes an allreduce the cycle's agreement already summed (`sum`: the sum of
/// every rank's prescaled tensor): applies the postscale, as [`reduce_bytes`] would,
/// and writes the result into this rank's tensor.
pub(crate) fn finish_speculated(
    ready: &Ready,
    mut local: Tensors,
    sum: &mut [f32],
    size: usize,
) -> Result<Output> {
    let mut tensor = take_tensor(ready, &mut local)?;
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(sum);
    scale_bytes(bytes, DType::F32, post_factor(ready.first(), size));
    let dst = tensor.host_bytes_mut();
    if dst.len() != bytes.len() {
        return Err(Error::Internal(format!(
            "{:?}: a speculated sum of {} bytes for a tensor of {}",
            ready.key,
            bytes.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(bytes);
    Ok(Output::Tensor(tensor))
}

fn allreduce(
    t: &mut dyn Transport,
    tensor: &mut Tensor,
    meta: &RequestMeta,
    size: usize,
) -> Result<()> {
    if tensor.is_empty() {
        return Ok(());
    }
    let dtype = tensor.dtype();
    reduce_bytes(t, tensor.host_bytes_mut(), dtype, meta, size)
}

/// Prescales `bytes`, reduces them in place over all ranks and postscales the result.
fn reduce_bytes(
    t: &mut dyn Transport,
    bytes: &mut [u8],
    dtype: DType,
    meta: &RequestMeta,
    size: usize,
) -> Result<()> {
    scale_bytes(bytes, dtype, meta.prescale);
    t.allreduce(bytes, dtype, meta.op)?;
    scale_bytes(bytes, dtype, post_factor(meta, size));
    Ok(())
}

/// Reduces a group's tensors of the same dtype together: the small ones are packed
/// into the persistent fusion buffer, reduced once, and copied back into the caller's
/// own tensors, which are handed back. A tensor above the fusion limit, or the only
/// small one of its dtype, is reduced in place without a copy, for the reason given at
/// `config::MAX_FUSED_TENSOR_BYTES` (the buffer's `max_tensor`): a bandwidth-bound tensor loses more to the copies
/// than it saves in latency (a Burn model's weight gradients go through here).
fn grouped_allreduce(
    t: &mut dyn Transport,
    inputs: Tensors,
    meta: &RequestMeta,
    size: usize,
    buffer: &mut FusionBuffer,
) -> Result<Vec<Tensor>> {
    let mut tensors = inputs.into_vec();
    let mut dtypes: SmallVec<[DType; 2]> = SmallVec::new();
    for x in &tensors {
        if !dtypes.contains(&x.dtype()) {
            dtypes.push(x.dtype());
        }
    }
    for dtype in dtypes {
        let mut members: Vec<&mut Tensor> = Vec::new();
        let mut large: Vec<&mut Tensor> = Vec::new();
        for x in tensors.iter_mut().filter(|x| x.dtype() == dtype) {
            if x.num_bytes() > buffer.max_tensor {
                large.push(x);
            } else {
                members.push(x);
            }
        }
        reduce_large(t, large, dtype, meta, size)?;
        if let [only] = members.as_mut_slice() {
            allreduce(t, only, meta, size)?;
            continue;
        }
        let total: usize = members.iter().map(|x| x.num_bytes()).sum();
        if total == 0 {
            continue;
        }
        let buf = buffer.bytes_mut(total);
        pack(buf, members.iter().map(|x| &**x));
        reduce_bytes(t, buf, dtype, meta, size)?;
        unpack(buf, members.iter_mut().map(|x| &mut **x));
    }
    Ok(tensors)
}

/// Reduces a group's members too large to fuse, each in its own tensor. Sums and
/// averages go to the transport in batches, as separate allreduces of that size do
/// (`fusion::in_place_batches`: one `Transport::allreduce_many` call per batch where
/// the transport takes groups); other ops, one call each.
fn reduce_large(
    t: &mut dyn Transport,
    large: Vec<&mut Tensor>,
    dtype: DType,
    meta: &RequestMeta,
    size: usize,
) -> Result<()> {
    let limit = match meta.op {
        ReduceOp::Sum | ReduceOp::Average => t.in_place_group_bytes(),
        _ => 0,
    };
    let sizes: Vec<usize> = large.iter().map(|x| x.num_bytes()).collect();
    let mut large: Vec<Option<&mut Tensor>> = large.into_iter().map(Some).collect();
    for batch in super::fusion::in_place_batches(&sizes, limit) {
        let mut members: Vec<&mut Tensor> = batch.iter().filter_map(|&i| large[i].take()).collect();
        match members.as_mut_slice() {
            [only] => allreduce(t, only, meta, size)?,
            many => reduce_many(t, many, dtype, meta, size)?,
        }
    }
    Ok(())
}

/// Reduces `tensors` (one dtype) in place with one `Transport::allreduce_many` call,
/// each prescaled before and postscaled after.
fn reduce_many(
    t: &mut dyn Transport,
    tensors: &mut [&mut Tensor],
    dtype: DType,
    meta: &RequestMeta,
    size: usize,
) -> Result<()> {
    for x in tensors.iter_mut() {
        scale_bytes(x.host_bytes_mut(), dtype, meta.prescale);
    }
    let mut bufs: Vec<&mut [u8]> = tensors
        .iter_mut()
        .map(|x| x.host_bytes_mut())
        .filter(|b| !b.is_empty())
        .collect();
    t.allreduce_many(&mut bufs, dtype, meta.op)?;
    let post = post_factor(meta, size);
    for x in tensors.iter_mut() {
        scale_bytes(x.host_bytes_mut(), dtype, post);
    }
    Ok(())
}

/// Copies `tensors` one after another into the front of `buf`.
fn pack<'a>(buf: &mut [u8], tensors: impl IntoIterator<Item = &'a Tensor>) {
    let mut at = 0;
    for x in tensors {
        let n = x.num_bytes();
        buf[at..at + n].copy_from_slice(x.host_bytes());
        at += n;
    }
}

/// Copies the front of `buf` back into `tensors`, in the order `pack` wrote them.
fn unpack<'a>(buf: &[u8], tensors: impl IntoIterator<Item = &'a mut Tensor>) {
    let mut at = 0;
    for x in tensors {
        let n = x.num_bytes();
        x.host_bytes_mut().copy_from_slice(&buf[at..at + n]);
        at += n;
    }
}

fn allgather(t: &mut dyn Transport, tensor: &Tensor, ready: &Ready) -> Result<Tensor> {
    let (counts, shape) = allgather_layout(ready, tensor.shape())?;
    super::grouped::gathered(t, tensor.host_bytes(), &counts, tensor.dtype(), &shape)
}

fn alltoall(t: &mut dyn Transport, tensor: &Tensor, ready: &Ready) -> Result<AlltoallOutput> {
    let l = alltoall_layout(ready, t.topology().rank, tensor.shape())?;
    let mut out = Tensor::zeros(tensor.dtype(), &l.shape);
    t.alltoallv(
        tensor.host_bytes(),
        &l.send_counts,
        out.host_bytes_mut(),
        &l.recv_counts,
        tensor.dtype(),
    )?;
    Ok(AlltoallOutput {
        tensor: out,
        received_splits: l.recv_rows,
    })
}

/// Reduces several ready allreduces that agree on dtype, op and scale factors in one
/// collective over the fusion buffer: copy in, prescale,
/// reduce in place, postscale, copy out. Members without local tensors (joined ranks)
/// contribute zeros and get `None` back.
pub(crate) fn run_fused(
    t: &mut dyn Transport,
    members: Vec<(&Ready, Option<Tensors>)>,
    buffer: &mut FusionBuffer,
) -> Result<(Vec<Option<Tensor>>, FusedTimes)> {
    timed(t, members, |t, members, size, times| {
        let meta = members[0].0.first().clone();
        let dtype = first_tensor(&meta, 0)?.dtype;
        let (mut tensors, local) = fused_inputs(members, |m| Ok(Tensor::zeros(m.dtype, &m.shape)))?;
        let total: usize = tensors.iter().map(Tensor::num_bytes).sum();
        let buf = buffer.bytes_mut(total);
        pack(buf, &tensors);
        scale_bytes(buf, dtype, meta.prescale);
        times.copied_in = Instant::now();
        t.allreduce(buf, dtype, meta.op)?;
        scale_bytes(buf, dtype, post_factor(&meta, size));
        times.reduced = Instant::now();
        unpack(buf, &mut tensors);
        Ok(tensors
            .into_iter()
            .zip(local)
            .map(|(x, mine)| mine.then_some(x))
            .collect())
    })
}

/// Reduces several allreduces too large to fuse (CPU sums of one dtype and scale
/// factors, as `fusion::plan` groups them) each in its own tensor, with one call of
/// the transport, which may move them together (`Transport::allreduce_many`): no copy
/// into the fusion buffer. A joined rank contributes zeros, as in a fused batch.
pub(crate) fn run_in_place_group(
    t: &mut dyn Transport,
    members: Vec<(&Ready, Option<Tensors>)>,
) -> Result<(Vec<Option<Tensor>>, FusedTimes)> {
    timed(t, members, |t, members, size, times| {
        let meta = members[0].0.first().clone();
        let dtype = first_tensor(&meta, 0)?.dtype;
        let (mut tensors, local) = fused_inputs(members, |m| Ok(Tensor::zeros(m.dtype, &m.shape)))?;
        times.copied_in = Instant::now();
        let mut all: Vec<&mut Tensor> = tensors.iter_mut().collect();
        reduce_many(t, &mut all, dtype, &meta, size)?;
        times.reduced = Instant::now();
        Ok(tensors
            .into_iter()
            .zip(local)
            .map(|(x, mine)| mine.then_some(x))
            .collect())
    })
}

/// Runs a fused collective's `body` (given the transport, the members, the number of
/// ranks and the times to mark) and times it; no members, nothing to run.
fn timed<'a>(
    t: &mut dyn Transport,
    members: Vec<(&'a Ready, Option<Tensors>)>,
    body: impl FnOnce(
        &mut dyn Transport,
        Vec<(&'a Ready, Option<Tensors>)>,
        usize,
        &mut FusedTimes,
    ) -> Result<Vec<Option<Tensor>>>,
) -> Result<(Vec<Option<Tensor>>, FusedTimes)> {
    let mut times = FusedTimes::at(Instant::now());
    if members.is_empty() {
        return Ok((Vec::new(), times));
    }
    let size = t.topology().size;
    let outputs = body(t, members, size, &mut times)?;
    times.copied_out = Instant::now();
    Ok((outputs, times))
}

/// Gathers several ready allgathers (same dtype, every rank taking part) in one
/// MPI_Allgatherv: each rank packs its tensors into the fusion buffer, the gathered
/// blocks arrive rank by rank, and are cut back out per tensor.
pub(crate) fn run_fused_allgather(
    t: &mut dyn Transport,
    members: Vec<(&Ready, Option<Tensors>)>,
    buffer: &mut FusionBuffer,
) -> Result<(Vec<Option<Tensor>>, FusedTimes)> {
    timed(t, members, |t, members, size, times| {
        let mut layouts = Vec::with_capacity(members.len());
        let mut inputs = Vec::with_capacity(members.len());
        for (ready, data) in members {
            let local = data.and_then(|mut v| v.pop()).ok_or_else(|| {
                Error::Internal(format!("fused allgather {:?} without a tensor", ready.key))
            })?;
            layouts.push(allgather_layout(ready, local.shape())?);
            inputs.push(local);
        }
        let dtype = inputs[0].dtype();
        let w = dtype.size_of();
        let per_rank: Vec<usize> = (0..size)
            .map(|r| layouts.iter().map(|(counts, _)| counts[r]).sum())
            .collect();
        let send_len: usize = inputs.iter().map(Tensor::len).sum();
        let recv_len: usize = per_rank.iter().sum();
        let buf = buffer.bytes_mut((send_len + recv_len) * w);
        let (send, recv) = buf.split_at_mut(send_len * w);
        pack(send, &inputs);
        times.copied_in = Instant::now();
        t.allgatherv(send, recv, &per_rank, dtype)?;
        times.reduced = Instant::now();
        let mut outputs: Vec<Tensor> = layouts
            .iter()
            .map(|(_, shape)| Tensor::zeros(dtype, shape))
            .collect();
        let mut filled = vec![0usize; outputs.len()];
        let mut at = 0;
        for r in 0..size {
            for (i, (counts, _)) in layouts.iter().enumerate() {
                let n = counts[r] * w;
                outputs[i].host_bytes_mut()[filled[i]..filled[i] + n]
                    .copy_from_slice(&recv[at..at + n]);
                filled[i] += n;
                at += n;
            }
        }
        Ok(outputs.into_iter().map(Some).collect())
    })
}

/// When the phases of a fused collective ended, for the timeline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FusedTimes {
    pub(crate) start: Instant,
    pub(crate) copied_in: Instant,
    pub(crate) reduced: Instant,
    pub(crate) copied_out: Instant,
}

impl FusedTimes {
    fn at(t: Instant) -> Self {
        FusedTimes {
            start: t,
            copied_in: t,
            reduced: t,
            copied_out: t,
        }
    }
}

fn reducescatter(
    t: &mut dyn Transport,
    mut tensor: Tensor,
    meta: &RequestMeta,
    size: usize,
) -> Result<Tensor> {
    let (counts, shape) = reducescatter_layout(tensor.shape(), size, t.topology().rank);
    let dtype = tensor.dtype();
    scale_bytes(tensor.host_bytes_mut(), dtype, meta.prescale);
    if size == 1 {
        // One rank: the tensor is its own reduction and its own block.
        scale_bytes(tensor.host_bytes_mut(), dtype, post_factor(meta, size));
        return Ok(tensor);
    }
    let mut out =
        super::grouped::scattered(t, tensor.host_bytes_mut(), &counts, dtype, meta.op, &shape)?;
    scale_bytes(out.host_bytes_mut(), dtype, post_factor(meta, size));
    Ok(out)
}
