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
        const CALL: &str = "MPI_Isend (send)";
        let dest = count(CALL, dest)?;
        for piece in buf.chunks(PIECE) {
            let mut req = null_request();
            let len = count(CALL, piece.len())?;
            // SAFETY: `piece` outlives the request, which `wait` completes before the
            // next piece or the return.
            check(CALL, unsafe {
                ffi::MPI_Isend(
                    piece.as_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    dest,
                    P2P_TAG,
                    self.comm(),
                    &mut req,
                )
            })?;
            self.wait(CALL, req, &mut |_| {})?;
        }
        Ok(())
    }

    /// Receives `buf.len()` bytes from `src`, piece by piece as they were sent.
    pub(super) fn recv_bytes(&mut self, buf: &mut [u8], src: usize) -> Result<()> {
        const CALL: &str = "MPI_Irecv (recv)";
        let src = count(CALL, src)?;
        for piece in buf.chunks_mut(PIECE) {
            let mut req = null_request();
            let len = count(CALL, piece.len())?;
            // SAFETY: as for the send.
            check(CALL, unsafe {
                ffi::MPI_Irecv(
                    piece.as_mut_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    src,
                    P2P_TAG,
                    self.comm(),
                    &mut req,
                )
            })?;
            self.wait(CALL, req, &mut |_| {})?;
        }
        Ok(())
    }
}
