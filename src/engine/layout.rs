//! The pure part of running a request, shared by the host path (`execute.rs`) and
//! the GPU path (`gpu.rs`): element counts and output shapes per rank, the inputs of
//! a fusion batch, scale factors. Another rank's request metadata is never indexed
//! blindly here: a malformed one is a named error.

use super::negotiate::Ready;
use super::request::{RequestMeta, Shape, TensorMeta, Tensors};
use crate::error::{Error, Result};
pub(crate) use crate::tensor::scale_bytes;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;
use smallvec::SmallVec;

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

fn row_len(shape: &[usize]) -> usize {
    shape.iter().skip(1).product()
}

/// Element counts per rank, inline for up to 8 ranks.
pub(super) type PerRank = SmallVec<[usize; 8]>;

/// An allgather's element count per rank and output shape (dim 0 may differ per
/// rank; a joined rank contributes nothing). Inline: a fused batch computes one per
/// tensor.
pub(super) fn allgather_layout(ready: &Ready, shape: &[usize]) -> Result<(PerRank, Shape)> {
    member_allgather_layout(ready, 0, shape)
}

/// [`allgather_layout`] of member `i` of a group (0: a single-tensor allgather).
pub(super) fn member_allgather_layout(
    ready: &Ready,
    i: usize,
    shape: &[usize],
) -> Result<(PerRank, Shape)> {
    let row = row_len(shape);
    let mut counts = PerRank::with_capacity(ready.metas.len());
    let mut rows = 0;
    for (r, m) in ready.metas.iter().enumerate() {
        let d0 = match m {
            Some(m) => member_dim0(m, r, i)?,
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
    member_dim0(m, r, 0)
}

/// Dim 0 of member `i` of rank `r`'s request.
fn member_dim0(m: &RequestMeta, r: usize, i: usize) -> Result<usize> {
    let t = m.tensors.get(i).ok_or_else(|| {
        Error::Internal(format!(
            "rank {r} sent a {} request for {:?} without a tensor{}",
            m.kind.name(),
            m.key,
            if i == 0 {
                String::new()
            } else {
                format!(" {i} (members 0..{})", m.tensors.len())
            }
        ))
    })?;
    t.shape.first().copied().ok_or_else(|| {
        Error::Internal(format!(
            "rank {r} sent a 0-d tensor for the {} of {:?}",
            m.kind.name(),
            m.key
        ))
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::OpKind;
    use crate::error::err_text;
    use crate::tensor::DType;

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
        let e = err_text(allgather_layout(&ready(vec![good.clone(), empty]), &[2, 3]));
        assert!(
            e.contains("rank 1 sent a allgather request for \"x\" without a tensor"),
            "{e}"
        );
        let scalar = RequestMeta::for_test("x", OpKind::Allgather, DType::F32, &[], ReduceOp::Sum);
        let e = err_text(allgather_layout(
            &ready(vec![good.clone(), scalar]),
            &[2, 3],
        ));
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
        let e = err_text(alltoall_layout(&ready(vec![a, bad]), 0, &[4]));
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
