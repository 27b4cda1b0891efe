//! Point to point between two ranks (pipeline stages): the bytes of one tensor, in
//! pieces of at most `i32::MAX` bytes, non-blocking and completed through
//! [`MpiTransport::wait`].

use super::*;

/// The tag of point-to-point messages (the ring uses 7, the cycle agreement 11).
const P2P_TAG: c_int = 13;

/// The largest piece one MPI call carries (its count is a C int).
const PIECE: usize = i32::MAX as usize;

impl MpiTransport {
    /// Sends `buf` to `dest`, piece by piece.
    pub(super) fn send_bytes(&mut self, buf: &[u8], dest: usize) -> Result<()> {
        self.in_pieces(
            "MPI_Isend (send)",
            buf.as_ptr().cast_mut(),
            buf.len(),
            dest,
            |p, n, peer, comm, req| {
                // SAFETY: the piece lies in `buf`, which outlives the request (`in_pieces`
                // completes it before the next piece or the return); MPI only reads it.
                unsafe { ffi::MPI_Isend(p.cast(), n, ffi::RSMPI_UINT8_T, peer, P2P_TAG, comm, req) }
            },
        )
    }

    /// Receives `buf.len()` bytes from `src`, piece by piece as they were sent.
    pub(super) fn recv_bytes(&mut self, buf: &mut [u8], src: usize) -> Result<()> {
        self.in_pieces(
            "MPI_Irecv (recv)",
            buf.as_mut_ptr(),
            buf.len(),
            src,
            |p, n, peer, comm, req| {
                // SAFETY: as for the send; MPI writes the piece, which nothing else uses.
                unsafe { ffi::MPI_Irecv(p.cast(), n, ffi::RSMPI_UINT8_T, peer, P2P_TAG, comm, req) }
            },
        )
    }

    /// Posts `post(piece, len, peer, comm, request)` for each piece of the `len` bytes
    /// at `base` in turn, waiting for each before the next.
    fn in_pieces(
        &mut self,
        call: &'static str,
        base: *mut u8,
        len: usize,
        peer: usize,
        mut post: impl FnMut(*mut u8, c_int, c_int, ffi::MPI_Comm, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let peer = count(call, peer)?;
        let mut at = 0;
        while at < len {
            let n = PIECE.min(len - at);
            let mut req = null_request();
            // `at < len`, so the piece starts inside the caller's buffer.
            let piece = base.wrapping_add(at);
            check(
                call,
                post(piece, count(call, n)?, peer, self.comm(), &mut req),
            )?;
            self.wait(call, req, &mut |_| {})?;
            at += n;
        }
        Ok(())
    }
}
