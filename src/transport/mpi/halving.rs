//! The sum for many ranks: recursive halving then doubling (Rabenseifner's
//! algorithm), 2·⌈log₂N⌉ messages per rank where the ring sends 2(N−1); the halving
//! stops once the piece a rank holds is small (`transport::choice::halvings`), and recursive doubling
//! sums the pieces in the steps left (a small sum is pure recursive doubling:
//! ⌈log₂N⌉ messages).
//!
//! Simulated at 512 to 4096 ranks (`kolo-sim`, DGX A100 preset), a flat ring's
//! start-ups made a 64 KiB–4 MiB sum take 5–41 ms instead of 0.05–0.2 ms; its bandwidth term is
//! the same as this algorithm's (2(N−1)/N of the buffer each way), so where the job is
//! large and the chunk a ring step would move is small, this is the sum to use
//! (`MpiTransport::flat_choice`).
//!
//! A rank count that is not a power of two first folds the extra ranks in: of ranks
//! 0..2r (r = N − 2^⌊log₂N⌋), each even rank sends its buffer to the odd rank after
//! it, which adds it and takes part in the halving for both; the even rank receives
//! the result at the end. The halving pairs the nearest ranks first (distance 1, 2,
//! 4, …): ranks of one host are numbered together, so the steps that move the most
//! bytes stay inside the host; those steps halve smaller pieces than the steps across
//! hosts do (`near`, from `Hosts::near_steps`). Each block's sum is computed by one rank and then
//! copied to all, so every rank ends with the same bits.

use std::ffi::c_int;

use mpi::ffi;

use super::group::Group;
use super::types::{addr, addr_mut, check, count, datatype};
use crate::error::Result;
use crate::tensor::DType;
use crate::transport::butterfly::Fold;
use crate::transport::choice::halvings;
use crate::transport::ring::add_into;

/// The tag of this algorithm's messages (the ring uses 7, the cycle agreement 11).
const TAG: c_int = 13;
const CALL: &str = "MPI_Sendrecv (halving-doubling allreduce)";

/// In-place sum of `buf` over `g` by recursive halving and doubling, of whose steps
/// the first `near` pair ranks of one host (the same on every rank); `scratch` is
/// kept between calls.
pub(super) fn halving_doubling(
    g: Group,
    near: u32,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    dtype: DType,
) -> Result<()> {
    let (n, me) = (g.size, g.rank);
    if n <= 1 {
        return Ok(());
    }
    let fold = Fold::new(n);
    if scratch.len() < buf.len() {
        scratch.resize(buf.len(), 0);
    }
    let folded = fold.folded(me);
    if folded {
        if me % 2 == 0 {
            exchange(g, me + 1, buf, &mut [], dtype)?;
        } else {
            exchange(g, me - 1, &[], &mut scratch[..buf.len()], dtype)?;
            add_into(buf, &scratch[..buf.len()], dtype);
        }
    }
    // This rank's place among the 2^k that halve, if it takes part.
    if let Some(v) = fold.participant(me) {
        let b = Butterfly {
            g,
            dtype,
            es: dtype.size_of(),
            len: buf.len() / dtype.size_of(),
            fold,
            v,
            near,
        };
        b.run(buf, scratch)?;
    }
    if folded {
        if me % 2 == 1 {
            exchange(g, me - 1, buf, &mut [], dtype)?;
        } else {
            exchange(g, me + 1, &[], buf, dtype)?;
        }
    }
    Ok(())
}

/// The 2^k ranks that halve and double, from one of them (`v`, its place among
/// them).
struct Butterfly {
    g: Group,
    dtype: DType,
    /// Bytes per element, and elements in the buffer.
    es: usize,
    len: usize,
    fold: Fold,
    /// This rank's place among the participants.
    v: usize,
    /// The leading steps whose partners share a host.
    near: u32,
}

impl Butterfly {
    /// The real rank of the participant `k` steps away.
    fn peer(&self, k: u32) -> usize {
        self.fold.peer(self.v, k)
    }

    /// Byte range of blocks `[a, b)` of the `p` blocks.
    fn bytes(&self, (a, b): (usize, usize)) -> (usize, usize) {
        let at = |c: usize| self.fold.block_start(self.len, c) * self.es;
        (at(a), at(b))
    }

    /// Halving, doubling on the piece, doubling back.
    fn run(&self, buf: &mut [u8], scratch: &mut [u8]) -> Result<()> {
        let steps = self.fold.steps();
        let halvings = halvings(buf.len(), steps, self.near);
        let mut held = (0usize, self.fold.p);
        let mut gave = Vec::with_capacity(halvings as usize);
        for k in 0..halvings {
            let (lo, hi) = held;
            let mid = (lo + hi) / 2;
            let (keep, give) = if self.v & (1 << k) == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            let (ka, kb) = self.bytes(keep);
            let (ga, gb) = self.bytes(give);
            let into = &mut scratch[..kb - ka];
            exchange(self.g, self.peer(k), &buf[ga..gb], into, self.dtype)?;
            add_into(&mut buf[ka..kb], into, self.dtype);
            gave.push((keep, give));
            held = keep;
        }
        // Recursive doubling on the piece: the partners of the remaining steps hold
        // the same blocks; each adds the other's (x + y == y + x: both get the same
        // bits).
        let (ha, hb) = self.bytes(held);
        for k in halvings..steps {
            let into = &mut scratch[..hb - ha];
            exchange(self.g, self.peer(k), &buf[ha..hb], into, self.dtype)?;
            add_into(&mut buf[ha..hb], into, self.dtype);
        }
        // Doubling back: send what this rank holds summed, receive the half it gave.
        for (k, (keep, give)) in gave.into_iter().enumerate().rev() {
            let (ka, kb) = self.bytes(keep);
            let (ga, gb) = self.bytes(give);
            let (send, recv) = if ka < ga {
                let (a, b) = buf.split_at_mut(ga);
                (&a[ka..kb], &mut b[..gb - ga])
            } else {
                let (a, b) = buf.split_at_mut(ka);
                (&b[..kb - ka], &mut a[ga..gb])
            };
            exchange(self.g, self.peer(k as u32), send, recv, self.dtype)?;
        }
        Ok(())
    }
}

/// Sends `send` to `peer` and receives `recv` from it at once (either may be empty).
fn exchange(g: Group, peer: usize, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
    let es = dtype.size_of();
    let peer = count(CALL, peer)?;
    let (ns, nr) = (count(CALL, send.len() / es)?, count(CALL, recv.len() / es)?);
    // SAFETY: both buffers are valid for their element counts and outlive the blocking
    // call; the empty ones get a placeholder address that MPI never touches.
    check(CALL, unsafe {
        ffi::MPI_Sendrecv(
            addr(send),
            ns,
            datatype(dtype),
            peer,
            TAG,
            addr_mut(recv),
            nr,
            datatype(dtype),
            peer,
            TAG,
            g.comm,
            ffi::RSMPI_STATUS_IGNORE,
        )
    })
}
