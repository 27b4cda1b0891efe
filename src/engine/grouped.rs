//! Running grouped allgathers and reducescatters on the host: the members of one
//! dtype that are small enough (each at most the fusion buffer's per-tensor limit)
//! move in one collective through the fusion buffer; larger members, and a dtype's
//! only small one, go on their own, without a copy, into outputs not zeroed first
//! (`gathered`, `scattered`: the single allgather and reducescatter use them too).

use super::fusion::FusionBuffer;
use super::layout::{member_allgather_layout, post_factor, reducescatter_layout, scale_bytes};
use super::negotiate::Ready;
use super::request::Tensors;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use crate::transport::Transport;
use crate::vocab::ReduceOp;

/// The members of `tensors` by dtype, in member order, each dtype once.
fn by_dtype(tensors: &[Tensor]) -> Vec<(DType, Vec<usize>)> {
    let mut out: Vec<(DType, Vec<usize>)> = Vec::new();
    for (i, x) in tensors.iter().enumerate() {
        match out.iter_mut().find(|(d, _)| *d == x.dtype()) {
            Some((_, idx)) => idx.push(i),
            None => out.push((x.dtype(), vec![i])),
        }
    }
    out
}

/// A dtype's `members` as (packed together, on their own): those of at most `max`
/// bytes go through the fusion buffer, unless only one is that small.
fn split(
    members: Vec<usize>,
    bytes: impl Fn(usize) -> usize,
    max: usize,
) -> (Vec<usize>, Vec<usize>) {
    let (small, large): (Vec<usize>, Vec<usize>) =
        members.into_iter().partition(|&i| bytes(i) <= max);
    match small.as_slice() {
        [_] => (Vec::new(), [large, small].concat()),
        _ => (small, large),
    }
}

/// Every member concatenated on dim 0 over the ranks, in member order.
pub(super) fn allgather(
    t: &mut dyn Transport,
    inputs: Tensors,
    ready: &Ready,
    buffer: &mut FusionBuffer,
) -> Result<Vec<Tensor>> {
    let tensors = inputs.into_vec();
    let size = t.topology().size;
    let mut layouts = Vec::with_capacity(tensors.len());
    for (i, x) in tensors.iter().enumerate() {
        layouts.push(member_allgather_layout(ready, i, x.shape())?);
    }
    if size == 1 {
        // Each member is its own gathering: no copy.
        return Ok(tensors);
    }
    let mut outputs: Vec<Option<Tensor>> = (0..tensors.len()).map(|_| None).collect();
    for (dtype, members) in by_dtype(&tensors) {
        let w = dtype.size_of();
        let bytes = |i: usize| layouts[i].1.iter().product::<usize>() * w;
        let (small, large) = split(members, bytes, buffer.max_tensor);
        for i in large {
            let (counts, shape) = &layouts[i];
            outputs[i] = Some(gathered(t, tensors[i].host_bytes(), counts, dtype, shape)?);
        }
        if small.is_empty() {
            continue;
        }
        for &i in &small {
            outputs[i] = Some(Tensor::zeros(dtype, &layouts[i].1));
        }
        let per_rank: Vec<usize> = (0..size)
            .map(|r| small.iter().map(|&i| layouts[i].0[r]).sum())
            .collect();
        let send_len: usize = small.iter().map(|&i| tensors[i].len()).sum();
        let recv_len: usize = per_rank.iter().sum();
        if recv_len == 0 {
            continue;
        }
        let buf = buffer.bytes_mut((send_len + recv_len) * w);
        let (send, recv) = buf.split_at_mut(send_len * w);
        let mut at = 0;
        for &i in &small {
            let n = tensors[i].num_bytes();
            send[at..at + n].copy_from_slice(tensors[i].host_bytes());
            at += n;
        }
        t.allgatherv(send, recv, &per_rank, dtype)?;
        // The blocks arrive rank by rank, each rank's members in member order.
        let mut filled = vec![0usize; outputs.len()];
        let mut at = 0;
        for r in 0..size {
            for &i in &small {
                let n = layouts[i].0[r] * w;
                if let Some(o) = outputs[i].as_mut() {
                    o.host_bytes_mut()[filled[i]..filled[i] + n].copy_from_slice(&recv[at..at + n]);
                }
                filled[i] += n;
                at += n;
            }
        }
    }
    every_member(outputs, ready)
}

/// The outputs, one per member: each dtype's pass made every one of its members'.
fn every_member(outputs: Vec<Option<Tensor>>, ready: &Ready) -> Result<Vec<Tensor>> {
    outputs
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            o.ok_or_else(|| Error::Internal(format!("member {i} of {:?} has no output", ready.key)))
        })
        .collect()
}

/// Every member reduced over the ranks, this rank keeping its block of dim 0, in
/// member order.
pub(super) fn reducescatter(
    t: &mut dyn Transport,
    inputs: Tensors,
    ready: &Ready,
    buffer: &mut FusionBuffer,
) -> Result<Vec<Tensor>> {
    let meta = ready.first();
    let (size, me) = (t.topology().size, t.topology().rank);
    let mut tensors = inputs.into_vec();
    let layouts: Vec<(Vec<usize>, Vec<usize>)> = tensors
        .iter()
        .map(|x| match x.shape() {
            [] => Err(Error::Internal(format!("a 0-d member in {:?}", ready.key))),
            s => Ok(reducescatter_layout(s, size, me)),
        })
        .collect::<Result<_>>()?;
    let post = post_factor(meta, size);
    if size == 1 {
        // Each member is its own reduction and its own block: scaled in place.
        for x in &mut tensors {
            let dtype = x.dtype();
            scale_bytes(x.host_bytes_mut(), dtype, meta.prescale);
            scale_bytes(x.host_bytes_mut(), dtype, post);
        }
        return Ok(tensors);
    }
    let mut outputs: Vec<Option<Tensor>> = (0..tensors.len()).map(|_| None).collect();
    for (dtype, members) in by_dtype(&tensors) {
        let w = dtype.size_of();
        let (small, large) = split(members, |i| tensors[i].num_bytes(), buffer.max_tensor);
        for i in large {
            let (counts, shape) = &layouts[i];
            let send = tensors[i].host_bytes_mut();
            scale_bytes(send, dtype, meta.prescale);
            let mut out = scattered(t, send, counts, dtype, meta.op, shape)?;
            scale_bytes(out.host_bytes_mut(), dtype, post);
            outputs[i] = Some(out);
        }
        if small.is_empty() {
            continue;
        }
        for &i in &small {
            outputs[i] = Some(Tensor::zeros(dtype, &layouts[i].1));
        }
        // Rank r's block of the buffer: each small member's rows for r, in member
        // order; one reduce-scatter leaves this rank its block of every member.
        let per_rank: Vec<usize> = (0..size)
            .map(|r| small.iter().map(|&i| layouts[i].0[r]).sum())
            .collect();
        let send_len: usize = per_rank.iter().sum();
        if send_len == 0 {
            continue;
        }
        let buf = buffer.bytes_mut((send_len + per_rank[me]) * w);
        let (send, recv) = buf.split_at_mut(send_len * w);
        let mut offsets = vec![0usize; tensors.len()];
        let mut at = 0;
        for r in 0..size {
            for &i in &small {
                let n = layouts[i].0[r] * w;
                send[at..at + n]
                    .copy_from_slice(&tensors[i].host_bytes()[offsets[i]..offsets[i] + n]);
                offsets[i] += n;
                at += n;
            }
        }
        scale_bytes(send, dtype, meta.prescale);
        t.reduce_scatter(send, recv, &per_rank, dtype, meta.op)?;
        scale_bytes(recv, dtype, post);
        let mut at = 0;
        for &i in &small {
            if let Some(o) = outputs[i].as_mut() {
                let n = o.num_bytes();
                o.host_bytes_mut().copy_from_slice(&recv[at..at + n]);
                at += n;
            }
        }
    }
    every_member(outputs, ready)
}

/// `send` gathered from every rank (`counts` elements each) into a new tensor of
/// `shape`, not zeroed first: the transport writes all of it.
pub(super) fn gathered(
    t: &mut dyn Transport,
    send: &[u8],
    counts: &[usize],
    dtype: DType,
    shape: &[usize],
) -> Result<Tensor> {
    // SAFETY: `allgatherv_fresh` writes all of the output when it returns Ok (the
    // transport's contract); an empty one needs nothing.
    unsafe {
        Tensor::written_by(dtype, shape, |recv| match recv.is_empty() {
            true => Ok(()),
            false => t.allgatherv_fresh(send, recv, counts, dtype),
        })
    }
}

/// This rank's block (`counts[rank]` elements of `shape`) of `send` reduced over the
/// ranks with `op`, in a new tensor not zeroed first: the transport writes all of it.
pub(super) fn scattered(
    t: &mut dyn Transport,
    send: &mut [u8],
    counts: &[usize],
    dtype: DType,
    op: ReduceOp,
    shape: &[usize],
) -> Result<Tensor> {
    // SAFETY: `reduce_scatter_fresh` writes all of the output when it returns Ok (the
    // transport's contract).
    unsafe {
        Tensor::written_by(dtype, shape, |recv| {
            t.reduce_scatter_fresh(send, recv, counts, dtype, op)
        })
    }
}
