//! Tensor fusion: which ready allreduces share one collective, and the persistent
//! buffer they are packed into.
//!
//! The plan is a pure function of the responses (identical on every rank) and the
//! threshold (rank 0's, agreed at start-up), so every rank packs the same batches.

use super::negotiate::{Ready, Response};
use super::request::{Device, OpKind};
use crate::config::MAX_FUSED_TENSOR_BYTES;
use crate::tensor::DType;
use crate::vocab::ReduceOp;

/// A cycle's plan: its steps in order (one inline, a lone op's).
pub(crate) type Steps = smallvec::SmallVec<[Step; 1]>;

/// One unit of execution, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Run response `i` on its own (in place for an allreduce).
    Single(usize),
    /// Run these responses (all allreduces, or all allgathers) as one collective
    /// through the fusion buffer.
    Fused(Vec<usize>),
    /// Run these allreduces (too large to fuse) each in its own buffer, handed to
    /// the transport together (`Transport::allreduce_many`).
    InPlace(Vec<usize>),
}

/// What must agree for two responses to share a buffer.
#[derive(Debug, PartialEq)]
struct FuseKey {
    kind: OpKind,
    device: Device,
    dtype: DType,
    op: ReduceOp,
    prescale: u64,
    postscale: u64,
}

impl FuseKey {
    /// The key of a response with at least one tensor (its first one's dtype).
    fn of(ready: &Ready) -> FuseKey {
        let m = ready.first();
        FuseKey {
            kind: ready.kind,
            device: m.device,
            dtype: m.tensors.first().map_or(DType::U8, |t| t.dtype),
            op: m.op,
            prescale: m.prescale.to_bits(),
            postscale: m.postscale.to_bits(),
        }
    }
}

fn fuse_key(r: &Response, max_tensor: usize) -> Option<(FuseKey, usize)> {
    let Response::Run(ready) = r else { return None };
    let m = ready.first();
    let t = m.tensors.first()?;
    let bytes = match ready.kind {
        OpKind::Allreduce => t.bytes(),
        // Allgathers fuse by their gathered size, on the CPU (MPI) path only, and only
        // when every rank takes part (with a joined rank they fail anyway).
        OpKind::Allgather if m.device == Device::Cpu => {
            let row: usize = t.shape.iter().skip(1).product();
            let mut rows = 0;
            for meta in ready.metas.iter() {
                rows += meta.as_ref()?.tensors.first()?.shape.first()?;
            }
            rows * row * t.dtype.size_of()
        }
        _ => return None,
    };
    (bytes <= max_tensor).then(|| (FuseKey::of(ready), bytes))
}

/// What must agree for allreduces too large to fuse to go to the transport together:
/// host sums (the ring's op) with the same dtype and scale factors.
fn in_place_key(r: &Response, max_tensor: usize) -> Option<(FuseKey, usize)> {
    let Response::Run(ready) = r else { return None };
    let m = ready.first();
    let t = m.tensors.first()?;
    let bytes = t.bytes();
    let eligible = ready.kind == OpKind::Allreduce
        && m.device == Device::Cpu
        && matches!(m.op, ReduceOp::Sum | ReduceOp::Average)
        && bytes > max_tensor;
    eligible.then(|| (FuseKey::of(ready), bytes))
}

/// Greedy fusion with look-ahead, as Horovod does: a batch starts at the first
/// unassigned allreduce (always taken, even above the threshold) and takes every later
/// matching allreduce that still fits, skipping non-matching responses rather than
/// stopping at them. A threshold of 0 disables fusion; tensors above `max_tensor`
/// bytes are never fused. With `in_place_group` > 0 (the transport's
/// `in_place_group_bytes`, the same on every rank) the allreduces too large to fuse
/// are grouped the same way, up to that many bytes, into [`Step::InPlace`] steps.
pub(crate) fn plan(
    responses: &[Response],
    threshold: usize,
    max_tensor: usize,
    in_place_group: usize,
) -> Steps {
    if let [_] = responses {
        // The common case of a latency-bound op: nothing to fuse with (and nothing
        // allocated).
        return smallvec::smallvec![Step::Single(0)];
    }
    let fused: Vec<Option<(FuseKey, usize)>> =
        responses.iter().map(|r| fuse_key(r, max_tensor)).collect();
    // Made only where the transport takes groups: most cycles plan without them.
    let grouped: Option<Vec<Option<(FuseKey, usize)>>> = (threshold > 0 && in_place_group > 0)
        .then(|| {
            responses
                .iter()
                .map(|r| in_place_key(r, max_tensor))
                .collect()
        });
    let mut taken = vec![false; responses.len()];
    let mut steps = Steps::new();
    for i in 0..responses.len() {
        if taken[i] {
            continue;
        }
        taken[i] = true;
        type Make = fn(Vec<usize>) -> Step;
        let group = grouped.as_deref().and_then(|g| Some((g[i].as_ref()?, g)));
        let (key, mut total, keys, limit, step): (_, _, &[_], _, Make) = match (&fused[i], group) {
            (Some((k, b)), _) => (k, *b, &fused, threshold, Step::Fused),
            (None, Some(((k, b), g))) => (k, *b, g, in_place_group, Step::InPlace),
            (None, None) => {
                steps.push(Step::Single(i));
                continue;
            }
        };
        let batch = fill(keys, i, key, &mut total, &mut taken, limit);
        steps.push(if batch.len() == 1 {
            Step::Single(i)
        } else {
            step(batch)
        });
    }
    steps
}

/// The rest of a batch that starts at `first` (already taken, whatever its size, with
/// `key` and `total` bytes): every later entry not yet taken whose key is `key` and
/// that still fits in `limit` bytes (0: none), in order, skipping the others.
fn fill<K: PartialEq>(
    keys: &[Option<(K, usize)>],
    first: usize,
    key: &K,
    total: &mut usize,
    taken: &mut [bool],
    limit: usize,
) -> Vec<usize> {
    let mut batch = vec![first];
    if limit == 0 {
        return batch;
    }
    for j in first + 1..keys.len() {
        if taken[j] {
            continue;
        }
        if let Some((k, b)) = &keys[j] {
            if k == key && *total + b <= limit {
                taken[j] = true;
                *total += b;
                batch.push(j);
            }
        }
    }
    batch
}

/// How the members of one `grouped_allreduce` that are too large to fuse (host sums
/// of one dtype, `sizes` bytes each, in order) go to the transport: by the rule
/// [`plan`] applies to separate allreduces — batches of up to `limit` bytes (the
/// transport's `in_place_group_bytes`) for `Transport::allreduce_many`, each batch
/// taking its first member whatever its size. `limit` 0: one member per batch.
pub(crate) fn in_place_batches(sizes: &[usize], limit: usize) -> Vec<Vec<usize>> {
    let keys: Vec<Option<((), usize)>> = sizes.iter().map(|&b| Some(((), b))).collect();
    let mut taken = vec![false; sizes.len()];
    let mut batches = Vec::new();
    for i in 0..sizes.len() {
        if taken[i] {
            continue;
        }
        taken[i] = true;
        let mut total = sizes[i];
        batches.push(fill(&keys, i, &(), &mut total, &mut taken, limit));
    }
    batches
}

/// The persistent fusion buffer: grows to the largest batch seen and is reused, so a
/// steady-state step allocates nothing. Backed by `u64` so that every dtype's view of
/// it is aligned.
#[derive(Debug)]
pub(crate) struct FusionBuffer {
    words: Vec<u64>,
    /// Tensors larger than this are reduced in place, not copied in (the agreed
    /// `KOLO_FUSION_MAX_TENSOR_BYTES`; see `config::MAX_FUSED_TENSOR_BYTES`).
    pub(crate) max_tensor: usize,
}

impl Default for FusionBuffer {
    fn default() -> Self {
        FusionBuffer {
            words: Vec::new(),
            max_tensor: MAX_FUSED_TENSOR_BYTES,
        }
    }
}

impl FusionBuffer {
    /// A zeroed-on-growth byte view of at least `bytes` bytes.
    pub(crate) fn bytes_mut(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.words)[..bytes]
    }

    /// Bytes the buffer holds now (it has grown to the largest batch so far).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.words.len() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::negotiate::Ready;
    use crate::engine::request::RequestMeta;
    use crate::error::Error;

    /// The plan as a `Vec`, to compare with `vec![…]`.
    fn plan(rs: &[Response], threshold: usize, max: usize, group: usize) -> Vec<Step> {
        super::plan(rs, threshold, max, group).into_vec()
    }

    fn allreduce(key: &str, len: usize, dtype: DType, op: ReduceOp) -> Response {
        let meta = RequestMeta::for_test(key, OpKind::Allreduce, dtype, &[len], op);
        Response::Run(Ready {
            key: key.into(),
            kind: OpKind::Allreduce,
            metas: vec![Some(std::sync::Arc::new(meta))].into(),
        })
    }

    #[test]
    fn fuses_matching_allreduces_up_to_the_threshold() {
        let rs = vec![
            allreduce("a", 10, DType::F32, ReduceOp::Sum),
            allreduce("b", 10, DType::F32, ReduceOp::Sum),
            allreduce("c", 10, DType::F32, ReduceOp::Sum),
        ];
        assert_eq!(
            plan(&rs, 80, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Fused(vec![0, 1]), Step::Single(2)]
        );
        assert_eq!(
            plan(&rs, 120, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Fused(vec![0, 1, 2])]
        );
        assert_eq!(
            plan(&rs, 0, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Single(0), Step::Single(1), Step::Single(2)]
        );
    }

    #[test]
    fn groups_large_host_sums_only_where_the_transport_takes_groups() {
        let big = MAX_FUSED_TENSOR_BYTES / 4 + 1;
        let rs = vec![
            allreduce("a", big, DType::F32, ReduceOp::Sum),
            allreduce("small", 10, DType::F32, ReduceOp::Sum),
            allreduce("max", big, DType::F32, ReduceOp::Max),
            allreduce("b", big, DType::F32, ReduceOp::Sum),
            allreduce("f64", big, DType::F64, ReduceOp::Sum),
            allreduce("c", big, DType::F32, ReduceOp::Sum),
            allreduce("avg", big, DType::F32, ReduceOp::Average),
        ];
        let m = MAX_FUSED_TENSOR_BYTES;
        // Without groups (one host, or a transport that takes none) each runs alone.
        assert_eq!(
            plan(&rs, 1 << 20, m, 0),
            (0..7).map(Step::Single).collect::<Vec<_>>()
        );
        // Sums of one dtype go together, looking past the others; Max never does.
        assert_eq!(
            plan(&rs, 1 << 20, m, 64 << 20),
            vec![
                Step::InPlace(vec![0, 3, 5]),
                Step::Single(1),
                Step::Single(2),
                Step::Single(4),
                Step::Single(6),
            ]
        );
        // Up to the group limit (the first always goes in), and not with fusion off.
        assert_eq!(
            plan(&rs, 1 << 20, m, 2 * (big * 4)),
            vec![
                Step::InPlace(vec![0, 3]),
                Step::Single(1),
                Step::Single(2),
                Step::Single(4),
                Step::Single(5),
                Step::Single(6),
            ]
        );
        assert_eq!(
            plan(&rs, 0, m, 64 << 20),
            (0..7).map(Step::Single).collect::<Vec<_>>()
        );
    }

    /// An allgather whose ranks contribute `rows[r]` rows of 4 f32.
    fn allgather(key: &str, rows: &[usize]) -> Response {
        let metas = rows
            .iter()
            .map(|&n| {
                let m = RequestMeta::for_test(
                    key,
                    OpKind::Allgather,
                    DType::F32,
                    &[n, 4],
                    ReduceOp::Sum,
                );
                Some(std::sync::Arc::new(m))
            })
            .collect();
        Response::Run(Ready {
            key: key.into(),
            kind: OpKind::Allgather,
            metas,
        })
    }

    #[test]
    fn allgathers_fuse_with_each_other_by_gathered_size_not_with_allreduces() {
        let rs = vec![
            allgather("g1", &[1, 2]),
            allreduce("a", 12, DType::F32, ReduceOp::Sum),
            allgather("g2", &[0, 3]),
            allreduce("b", 12, DType::F32, ReduceOp::Sum),
            allgather("g3", &[4, 0]),
        ];
        // Gathered sizes: 48, 48 and 64 bytes.
        assert_eq!(
            plan(&rs, 1 << 20, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Fused(vec![0, 2, 4]), Step::Fused(vec![1, 3])]
        );
        assert_eq!(
            plan(&rs, 100, MAX_FUSED_TENSOR_BYTES, 0),
            vec![
                Step::Fused(vec![0, 2]),
                Step::Fused(vec![1, 3]),
                Step::Single(4)
            ]
        );
        // A rank that did not submit (joined): never fused.
        let Response::Run(mut joined) = allgather("j", &[1, 1]) else {
            unreachable!()
        };
        joined.metas = std::sync::Arc::from([joined.metas[0].clone(), None]);
        let joined = Response::Run(joined);
        assert_eq!(
            plan(
                &[allgather("g", &[1, 1]), joined],
                1 << 20,
                MAX_FUSED_TENSOR_BYTES,
                0
            ),
            vec![Step::Single(0), Step::Single(1)]
        );
    }

    #[test]
    fn looks_ahead_past_non_matching_responses() {
        let rs = vec![
            allreduce("a", 4, DType::F32, ReduceOp::Sum),
            allreduce("x", 4, DType::F64, ReduceOp::Sum),
            Response::Fail {
                key: "bad".into(),
                error: Error::Internal("test".into()),
            },
            allreduce("y", 4, DType::F32, ReduceOp::Max),
            allreduce("b", 4, DType::F32, ReduceOp::Sum),
            allreduce("z", 4, DType::F64, ReduceOp::Sum),
        ];
        assert_eq!(
            plan(&rs, 1 << 20, MAX_FUSED_TENSOR_BYTES, 0),
            vec![
                Step::Fused(vec![0, 4]),
                Step::Fused(vec![1, 5]),
                Step::Single(2),
                Step::Single(3)
            ]
        );
    }

    #[test]
    fn the_first_tensor_is_taken_even_above_the_threshold() {
        let rs = vec![
            allreduce("big", 1000, DType::F32, ReduceOp::Sum),
            allreduce("small", 1, DType::F32, ReduceOp::Sum),
        ];
        assert_eq!(
            plan(&rs, 16, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Single(0), Step::Single(1)]
        );
    }

    #[test]
    fn large_tensors_are_never_fused() {
        let big = MAX_FUSED_TENSOR_BYTES / 4 + 1;
        let rs = vec![
            allreduce("a", 4, DType::F32, ReduceOp::Sum),
            allreduce("big", big, DType::F32, ReduceOp::Sum),
            allreduce("b", 4, DType::F32, ReduceOp::Sum),
        ];
        assert_eq!(
            plan(&rs, 64 << 20, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Fused(vec![0, 2]), Step::Single(1)]
        );
        // A raised limit (slow links) fuses them up to the threshold.
        assert_eq!(
            plan(&rs, 64 << 20, usize::MAX, 0),
            vec![Step::Fused(vec![0, 1, 2])]
        );
        assert_eq!(
            plan(&rs, big * 4 + 16, usize::MAX, 0),
            vec![Step::Fused(vec![0, 1]), Step::Single(2)]
        );
    }

    #[test]
    fn half_types_count_at_their_width() {
        let rs = vec![
            allreduce("a", 4, DType::F16, ReduceOp::Sum),
            allreduce("b", 4, DType::F16, ReduceOp::Sum),
        ];
        assert_eq!(
            plan(&rs, 8, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Single(0), Step::Single(1)]
        );
        assert_eq!(
            plan(&rs, 16, MAX_FUSED_TENSOR_BYTES, 0),
            vec![Step::Fused(vec![0, 1])]
        );
    }

    #[test]
    fn buffer_is_reused_and_aligned() {
        let mut b = FusionBuffer::default();
        let p = b.bytes_mut(100).as_ptr();
        assert_eq!(p as usize % 8, 0);
        assert_eq!(b.bytes_mut(40).as_ptr(), p);
    }
}
