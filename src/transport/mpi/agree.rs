//! The cycle agreement's messages: words swapped with one peer at a time, ANDed.

use super::*;

/// `acc &= x`, word by word.
pub(super) fn and_into(acc: &mut [u64], x: &[u64]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a &= *b;
    }
}

/// The tag of the cycle agreement's messages (the ring uses 7).
const AGREE_TAG: c_int = 11;

impl MpiTransport {
    /// Sends `send` to and/or receives `recv` from `peer` (non-blocking, completed
    /// together through [`MpiTransport::wait`], so the engine stays responsive).
    pub(super) fn swap_words(
        &mut self,
        call: &'static str,
        peer: usize,
        send: Option<&[u64]>,
        recv: Option<&mut [u64]>,
        idle: &mut dyn FnMut(Duration),
    ) -> Result<()> {
        let peer = count(call, peer)?;
        // Named before anything is posted: a partitioned peer can hold up the posting
        // itself (a TCP send that cannot drain), and the watchdog should still name it.
        self.awaited
            .set(self.job_ranks.get(to_usize(peer)).copied());
        let swapped = self.post_and_wait(call, peer, send, recv, idle);
        self.awaited.set(None);
        swapped
    }

    /// [`swap_words`](Self::swap_words) once the awaited peer is recorded.
    fn post_and_wait(
        &mut self,
        call: &'static str,
        peer: c_int,
        send: Option<&[u64]>,
        recv: Option<&mut [u64]>,
        idle: &mut dyn FnMut(Duration),
    ) -> Result<()> {
        let comm = self.comm();
        let mut reqs = [null_request(), null_request()];
        if let Some(buf) = recv {
            let len = count(call, buf.len())?;
            // SAFETY: `buf` outlives the request, which is completed below before
            // this returns (also on error: `wait` is called for both requests).
            check(call, unsafe {
                ffi::MPI_Irecv(
                    buf.as_mut_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT64_T,
                    peer,
                    AGREE_TAG,
                    comm,
                    &mut reqs[0],
                )
            })?;
        }
        if let Some(buf) = send {
            let len = count(call, buf.len())?;
            // SAFETY: as for the receive.
            let rc = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT64_T,
                    peer,
                    AGREE_TAG,
                    comm,
                    &mut reqs[1],
                )
            };
            if let Err(e) = check(call, rc) {
                self.wait(call, reqs[0], idle)?;
                return Err(e);
            }
        }
        let first = self.wait(call, reqs[0], idle);
        let second = self.wait(call, reqs[1], idle);
        first.and(second)
    }
}
