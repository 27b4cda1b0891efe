//! Runs a negotiated request on this rank: prepares buffers, calls the transport,
//! applies scale factors and hands back the result.

use std::time::Instant;

use half::{bf16, f16};

use super::fusion::{FusionBuffer, MAX_FUSED_TENSOR_BYTES};
use super::negotiate::Ready;
use super::request::{OpKind, RequestMeta, Shape, TensorMeta, Tensors};
use crate::error::{Error, Result};
use crate::handle::Output;
use crate::tensor::{DType, Tensor};
use crate::transport::Transport;
use crate::vocab::{AlltoallOutput, ReduceOp};
use smallvec::SmallVec;

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
        OpKind::Allgather => Ok(Output::Tensor(allgather(t, &take(&mut inputs)?, ready)?)),
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
        OpKind::Join => Err(Error::Internal("join reached the executor".into())),
    }
}

/// This rank's tensors of `ready`, or — on a joined rank, which has none — `zeros` of
/// the agreed shapes.
pub(super) fn local_or_zeros(
    ready: &Ready,
    local: Option<Tensors>,
    zeros: impl FnMut(&TensorMeta) -> Result<Tensor>,
) -> Result<Tensors> {
    match local {
        Some(v) => Ok(v),
        None => ready.first().tensors.iter().map(zeros).collect(),
    }
}

/// The (last) tensor of a single-tensor op.
pub(super) fn take_tensor(ready: &Ready, inputs: &mut Tensors) -> Result<Tensor> {
    inputs
        .pop()
        .ok_or_else(|| Error::Internal(format!("{:?} has no tensor", ready.key)))
}

/// The factor applied after the reduction: postscale, divided by `size` for Average
/// (the full size, also when ranks have joined, as in Horovod).
pub(super) fn post_factor(meta: &RequestMeta, size: usize) -> f64 {
    match meta.op {
        ReduceOp::Average => meta.postscale / size as f64,
        _ => meta.postscale,
    }
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
/// [`MAX_FUSED_TENSOR_BYTES`]: a bandwidth-bound tensor loses more to the copies
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
        for x in tensors.iter_mut().filter(|x| x.dtype() == dtype) {
            if x.num_bytes() > MAX_FUSED_TENSOR_BYTES {
                allreduce(t, x, meta, size)?;
            } else {
                members.push(x);
            }
        }
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

fn row_len(shape: &[usize]) -> usize {
    shape.iter().skip(1).product()
}

/// Element counts per rank, inline for up to 8 ranks.
pub(super) type PerRank = SmallVec<[usize; 8]>;

/// An allgather's element count per rank and output shape (dim 0 may differ per
/// rank; a joined rank contributes nothing). Inline: a fused batch computes one per
/// tensor.
pub(super) fn allgather_layout(ready: &Ready, shape: &[usize]) -> Result<(PerRank, Shape)> {
    let row = row_len(shape);
    let mut counts = PerRank::with_capacity(ready.metas.len());
    let mut rows = 0;
    for (r, m) in ready.metas.iter().enumerate() {
        let d0 = match m {
            Some(m) => dim0(m, r)?,
            None => 0,
        };
        counts.push(d0 * row);
        rows += d0;
    }
    let mut out = Shape::from_slice(shape);
    if let Some(d) = out.first_mut() {
        *d = rows;
    }
    Ok((counts, out))
}

/// The first tensor of rank `r`'s request: another rank's message is not indexed
/// blindly (a malformed one is a named error, not a panic of the engine).
pub(super) fn first_tensor(m: &RequestMeta, r: usize) -> Result<&TensorMeta> {
    m.tensors.first().ok_or_else(|| {
        Error::Internal(format!(
            "rank {r} sent a {} request for {:?} without a tensor",
            m.kind.name(),
            m.key
        ))
    })
}

/// Dim 0 of rank `r`'s tensor.
fn dim0(m: &RequestMeta, r: usize) -> Result<usize> {
    first_tensor(m, r)?.shape.first().copied().ok_or_else(|| {
        Error::Internal(format!(
            "rank {r} sent a 0-d tensor for the {} of {:?}",
            m.kind.name(),
            m.key
        ))
    })
}

fn allgather(t: &mut dyn Transport, tensor: &Tensor, ready: &Ready) -> Result<Tensor> {
    let (counts, shape) = allgather_layout(ready, tensor.shape())?;
    let mut out = Tensor::zeros(tensor.dtype(), &shape);
    if !out.is_empty() {
        t.allgatherv(
            tensor.host_bytes(),
            out.host_bytes_mut(),
            &counts,
            tensor.dtype(),
        )?;
    }
    Ok(out)
}

/// Rows rank `r` sends to each rank: its splits, or dim 0 divided equally.
fn send_splits(meta: &RequestMeta, r: usize, size: usize) -> Result<Vec<usize>> {
    match &meta.splits {
        Some(s) if s.len() == size => Ok(s.clone()),
        Some(s) => Err(Error::Internal(format!(
            "rank {r} sent {} splits for the alltoall of {:?} among {size} ranks",
            s.len(),
            meta.key
        ))),
        None => Ok(vec![dim0(meta, r)? / size.max(1); size]),
    }
}

/// What this rank sends to and receives from each rank in an alltoall.
pub(super) struct AlltoallLayout {
    pub(super) send_counts: Vec<usize>,
    pub(super) recv_counts: Vec<usize>,
    pub(super) recv_rows: Vec<usize>,
    pub(super) shape: Vec<usize>,
}

/// Element counts and output shape of rank `me`'s alltoall of a tensor of `shape`.
pub(super) fn alltoall_layout(ready: &Ready, me: usize, shape: &[usize]) -> Result<AlltoallLayout> {
    let size = ready.metas.len();
    let mine = ready.metas[me]
        .as_ref()
        .ok_or_else(|| Error::Internal("alltoall on a rank without a request".into()))?;
    let row = row_len(shape);
    let send_rows = send_splits(mine, me, size)?;
    let mut recv_rows = Vec::with_capacity(size);
    for (r, m) in ready.metas.iter().enumerate() {
        let m = m
            .as_ref()
            .ok_or_else(|| Error::Internal("alltoall with a joined rank".into()))?;
        recv_rows.push(send_splits(m, r, size)?[me]);
    }
    let mut out = shape.to_vec();
    if let Some(d) = out.first_mut() {
        *d = recv_rows.iter().sum();
    }
    Ok(AlltoallLayout {
        send_counts: send_rows.iter().map(|r| r * row).collect(),
        recv_counts: recv_rows.iter().map(|r| r * row).collect(),
        recv_rows,
        shape: out,
    })
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
    let start = Instant::now();
    let size = t.topology().size;
    let Some((first, _)) = members.first() else {
        return Ok((Vec::new(), FusedTimes::at(start)));
    };
    let meta = first.first().clone();
    let dtype = first_tensor(&meta, 0)?.dtype;
    let (mut tensors, local) = fused_inputs(members, |m| Ok(Tensor::zeros(m.dtype, &m.shape)))?;
    let total: usize = tensors.iter().map(Tensor::num_bytes).sum();
    let buf = buffer.bytes_mut(total);
    pack(buf, &tensors);
    scale_bytes(buf, dtype, meta.prescale);
    let copied_in = Instant::now();
    t.allreduce(buf, dtype, meta.op)?;
    scale_bytes(buf, dtype, post_factor(&meta, size));
    let reduced = Instant::now();
    unpack(buf, &mut tensors);
    let outputs = tensors
        .into_iter()
        .zip(local)
        .map(|(x, mine)| mine.then_some(x))
        .collect();
    let times = FusedTimes {
        start,
        copied_in,
        reduced,
        copied_out: Instant::now(),
    };
    Ok((outputs, times))
}

/// The tensors of a fusion batch in order — this rank's, or `zeros` of the agreed
/// shape where it has none (a joined rank) — and which were this rank's.
pub(super) fn fused_inputs(
    members: Vec<(&Ready, Option<Tensors>)>,
    mut zeros: impl FnMut(&TensorMeta) -> Result<Tensor>,
) -> Result<(Vec<Tensor>, Vec<bool>)> {
    let mut tensors = Vec::with_capacity(members.len());
    let mut local = Vec::with_capacity(members.len());
    for (ready, data) in members {
        local.push(data.is_some());
        let tensor = match data.and_then(|mut v| v.pop()) {
            Some(t) => t,
            None => zeros(first_tensor(ready.first(), 0)?)?,
        };
        tensors.push(tensor);
    }
    Ok((tensors, local))
}

/// Gathers several ready allgathers (same dtype, every rank taking part) in one
/// MPI_Allgatherv: each rank packs its tensors into the fusion buffer, the gathered
/// blocks arrive rank by rank, and are cut back out per tensor.
pub(crate) fn run_fused_allgather(
    t: &mut dyn Transport,
    members: Vec<(&Ready, Option<Tensors>)>,
    buffer: &mut FusionBuffer,
) -> Result<(Vec<Option<Tensor>>, FusedTimes)> {
    let start = Instant::now();
    let size = t.topology().size;
    let mut layouts = Vec::with_capacity(members.len());
    let mut inputs = Vec::with_capacity(members.len());
    for (ready, data) in members {
        let local = data.and_then(|mut v| v.pop()).ok_or_else(|| {
            Error::Internal(format!("fused allgather {:?} without a tensor", ready.key))
        })?;
        layouts.push(allgather_layout(ready, local.shape())?);
        inputs.push(local);
    }
    let Some(dtype) = inputs.first().map(Tensor::dtype) else {
        return Ok((Vec::new(), FusedTimes::at(start)));
    };
    let w = dtype.size_of();
    let per_rank: Vec<usize> = (0..size)
        .map(|r| layouts.iter().map(|(counts, _)| counts[r]).sum())
        .collect();
    let send_len: usize = inputs.iter().map(Tensor::len).sum();
    let recv_len: usize = per_rank.iter().sum();
    let buf = buffer.bytes_mut((send_len + recv_len) * w);
    let (send, recv) = buf.split_at_mut(send_len * w);
    pack(send, &inputs);
    let copied_in = Instant::now();
    t.allgatherv(send, recv, &per_rank, dtype)?;
    let reduced = Instant::now();
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
    let times = FusedTimes {
        start,
        copied_in,
        reduced,
        copied_out: Instant::now(),
    };
    Ok((outputs.into_iter().map(Some).collect(), times))
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

/// Multiplies every element of raw bytes holding `dtype` elements by `f`; integers
/// are scaled in f64 and rounded (saturating).
pub(crate) fn scale_bytes(bytes: &mut [u8], dtype: DType, f: f64) {
    if f == 1.0 {
        return;
    }
    macro_rules! typed {
        ($t:ty) => {
            bytemuck::cast_slice_mut::<u8, $t>(bytes)
        };
    }
    match dtype {
        DType::F32 => {
            let f = f as f32;
            typed!(f32).iter_mut().for_each(|x| *x *= f);
        }
        DType::F64 => typed!(f64).iter_mut().for_each(|x| *x *= f),
        DType::U8 => typed!(u8)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as u8),
        DType::I8 => typed!(i8)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as i8),
        DType::I32 => typed!(i32)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as i32),
        DType::I64 => typed!(i64)
            .iter_mut()
            .for_each(|x| *x = (*x as f64 * f).round() as i64),
        // Scaled in f32, rounded once.
        DType::F16 => {
            let f = f as f32;
            typed!(f16)
                .iter_mut()
                .for_each(|x| *x = f16::from_f32(x.to_f32() * f));
        }
        DType::BF16 => {
            let f = f as f32;
            typed!(bf16)
                .iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() * f));
        }
    }
}

/// Rows of dim 0 that rank `r` receives: the first `d0 % size` ranks get one extra.
pub(crate) fn scatter_rows(d0: usize, size: usize, r: usize) -> usize {
    d0 / size + usize::from(r < d0 % size)
}

/// A reducescatter's element count per rank and rank `me`'s output shape.
pub(super) fn reducescatter_layout(
    shape: &[usize],
    size: usize,
    me: usize,
) -> (Vec<usize>, Vec<usize>) {
    let row = row_len(shape);
    let d0 = shape[0];
    let counts = (0..size).map(|r| scatter_rows(d0, size, r) * row).collect();
    let mut out = shape.to_vec();
    out[0] = scatter_rows(d0, size, me);
    (counts, out)
}

fn reducescatter(
    t: &mut dyn Transport,
    mut tensor: Tensor,
    meta: &RequestMeta,
    size: usize,
) -> Result<Tensor> {
    let (counts, shape) = reducescatter_layout(tensor.shape(), size, t.topology().rank);
    let mut out = Tensor::zeros(tensor.dtype(), &shape);
    let dtype = tensor.dtype();
    scale_bytes(tensor.host_bytes_mut(), dtype, meta.prescale);
    t.reduce_scatter(
        tensor.host_bytes(),
        out.host_bytes_mut(),
        &counts,
        dtype,
        meta.op,
    )?;
    scale_bytes(out.host_bytes_mut(), dtype, post_factor(meta, size));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_scaling_rounds_in_f64() {
        let mut v = vec![3i32, -3, 10];
        scale_bytes(bytemuck::cast_slice_mut(&mut v), DType::I32, 0.5);
        assert_eq!(v, [2, -2, 5]);
    }

    fn ready(metas: Vec<RequestMeta>) -> Ready {
        let metas: Vec<Option<std::sync::Arc<RequestMeta>>> = metas
            .into_iter()
            .map(|m| Some(std::sync::Arc::new(m)))
            .collect();
        Ready {
            key: "x".into(),
            kind: metas[0].as_ref().map_or(OpKind::Allgather, |m| m.kind),
            metas: metas.into(),
        }
    }

    #[test]
    fn malformed_peer_requests_are_errors_not_panics() {
        let good =
            RequestMeta::for_test("x", OpKind::Allgather, DType::F32, &[2, 3], ReduceOp::Sum);
        // Rank 1 sent no tensor, then a 0-d one.
        let mut empty = good.clone();
        empty.tensors.clear();
        let e = allgather_layout(&ready(vec![good.clone(), empty]), &[2, 3])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("rank 1 sent a allgather request for \"x\" without a tensor"),
            "{e}"
        );
        let scalar = RequestMeta::for_test("x", OpKind::Allgather, DType::F32, &[], ReduceOp::Sum);
        let e = allgather_layout(&ready(vec![good.clone(), scalar]), &[2, 3])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("rank 1 sent a 0-d tensor"), "{e}");
        let (counts, shape) =
            allgather_layout(&ready(vec![good.clone(), good]), &[2, 3]).unwrap_or_default();
        assert_eq!(
            (counts.as_slice(), shape.as_slice()),
            (&[6, 6][..], &[4, 3][..])
        );

        // Rank 1's alltoall splits have the wrong length.
        let a = RequestMeta::for_test("y", OpKind::Alltoall, DType::F32, &[4], ReduceOp::Sum);
        let mut bad = a.clone();
        bad.splits = Some(vec![4]);
        let e = alltoall_layout(&ready(vec![a, bad]), 0, &[4])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("rank 1 sent 1 splits for the alltoall of \"y\" among 2 ranks"),
            "{e}"
        );
    }

    #[test]
    fn scatter_rows_give_extra_rows_to_first_ranks() {
        let rows: Vec<usize> = (0..3).map(|r| scatter_rows(7, 3, r)).collect();
        assert_eq!(rows, [3, 2, 2]);
        assert_eq!(rows.iter().sum::<usize>(), 7);
    }
}
