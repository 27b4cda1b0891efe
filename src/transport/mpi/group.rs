//! A communicator with this rank's place in it (`Group`), and the blocking
//! data-plane collectives on one: flat on kolo's communicator, or on the hierarchical
//! allreduce's levels.

use std::mem::MaybeUninit;

use mpi::ffi;

use super::kolo_mpi_in_place;
use super::types::{
    addr, addr_mut, check, count, counts, datatype, per_rank, sized, MAX_ELEMS_PER_CALL,
};
use crate::error::Result;
use crate::tensor::DType;

/// A communicator with this rank's place in it: what the data-plane collectives
/// below run on (kolo's own communicator, or the hierarchical allreduce's levels).
#[derive(Debug, Clone, Copy)]
pub(super) struct Group {
    pub(super) comm: ffi::MPI_Comm,
    pub(super) size: usize,
    pub(super) rank: usize,
}

/// In-place MPI_Allreduce of `buf` over `g`.
pub(super) fn allreduce_in_place(
    g: Group,
    buf: &mut [u8],
    dtype: DType,
    op: ffi::MPI_Op,
) -> Result<()> {
    const CALL: &str = "MPI_Allreduce";
    // Element-wise, so 2^31 elements or more can go in chunks (MPI counts are C ints).
    for chunk in buf.chunks_mut(MAX_ELEMS_PER_CALL * dtype.size_of()) {
        let n = count(CALL, chunk.len() / dtype.size_of())?;
        // SAFETY: `chunk` is valid for the call; MPI_IN_PLACE comes from the MPI
        // header through the C shim.
        check(CALL, unsafe {
            ffi::MPI_Allreduce(
                kolo_mpi_in_place(),
                chunk.as_mut_ptr().cast(),
                n,
                datatype(dtype),
                op,
                g.comm,
            )
        })?;
    }
    Ok(())
}

/// MPI_Allgatherv over `g`: rank `r` gives `counts_[r]` elements.
pub(super) fn allgatherv_on(
    g: Group,
    send: &[u8],
    recv: &mut [u8],
    counts_: &[usize],
    dtype: DType,
) -> Result<()> {
    allgatherv_fresh_on(g, send, as_uninit(recv), counts_, dtype)
}

/// The bytes of `buf` as memory MPI may write (it only ever writes real data there).
pub(super) fn as_uninit(buf: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: same length and layout; what is written through the view is initialised
    // data (MPI receives, kolo's sums), so `buf` stays initialised.
    unsafe { &mut *(std::ptr::from_mut::<[u8]>(buf) as *mut [MaybeUninit<u8>]) }
}

/// [`allgatherv_on`] into fresh memory: on `Ok`, MPI has written all of `recv` (its
/// length is checked to be the sum of the counts).
pub(super) fn allgatherv_fresh_on(
    g: Group,
    send: &[u8],
    recv: &mut [MaybeUninit<u8>],
    counts_: &[usize],
    dtype: DType,
) -> Result<()> {
    const CALL: &str = "MPI_Allgatherv";
    per_rank(CALL, counts_, g.size)?;
    sized(CALL, "send", send.len(), counts_[g.rank], dtype)?;
    sized(CALL, "receive", recv.len(), counts_.iter().sum(), dtype)?;
    let (c, displs) = counts(CALL, counts_)?;
    // SAFETY: the buffers hold exactly what the counts say (checked above) and the
    // count arrays outlive the call.
    check(CALL, unsafe {
        ffi::MPI_Allgatherv(
            addr(send),
            c[g.rank],
            datatype(dtype),
            addr_mut(recv),
            c.as_ptr(),
            displs.as_ptr(),
            datatype(dtype),
            g.comm,
        )
    })
}

/// MPI_Reduce_scatter over `g`: block `r` (`counts_[r]` elements) lands on rank `r`.
pub(super) fn reduce_scatter_on(
    g: Group,
    send: &[u8],
    recv: &mut [u8],
    counts_: &[usize],
    dtype: DType,
    op: ffi::MPI_Op,
) -> Result<()> {
    reduce_scatter_fresh_on(g, send, as_uninit(recv), counts_, dtype, op)
}

/// [`reduce_scatter_on`] into fresh memory: on `Ok`, MPI has written all of `recv`
/// (its length is checked to be this rank's count).
pub(super) fn reduce_scatter_fresh_on(
    g: Group,
    send: &[u8],
    recv: &mut [MaybeUninit<u8>],
    counts_: &[usize],
    dtype: DType,
    op: ffi::MPI_Op,
) -> Result<()> {
    const CALL: &str = "MPI_Reduce_scatter";
    per_rank(CALL, counts_, g.size)?;
    sized(CALL, "send", send.len(), counts_.iter().sum(), dtype)?;
    sized(CALL, "receive", recv.len(), counts_[g.rank], dtype)?;
    let (c, _) = counts(CALL, counts_)?;
    // SAFETY: the buffers hold exactly what the counts say (checked above) and the
    // count array outlives the call.
    check(CALL, unsafe {
        ffi::MPI_Reduce_scatter(
            addr(send),
            addr_mut(recv),
            c.as_ptr(),
            datatype(dtype),
            op,
            g.comm,
        )
    })
}
