//! The cycle agreement's messages: words swapped with one peer at a time, ANDed.

use super::*;

/// `acc &= x`, word by word.
pub(super) fn and_into(acc: &mut [u64], x: &[u64]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a &= *b;
    }
}

/// A message of `len` words at most needs this many: a bitmap of the non-zero words
/// (one bit a word), then those words.
pub(super) fn sparse_capacity(len: usize) -> usize {
    len.div_ceil(64) + len
}

/// The agreement's words and values as sent: mostly zeros (cache bits of ops not
/// pending, values not speculated on), so only the non-zero words go, after a bitmap
/// saying where they belong. A small op's message shrinks from about 700 bytes to
/// about 100, which a message between two ranks of one host feels (issue 34).
pub(super) fn pack_sparse(words: &[u64], out: &mut Words) {
    out.clear();
    out.resize(words.len().div_ceil(64), 0);
    for (i, &w) in words.iter().enumerate() {
        if w != 0 {
            out[i / 64] |= 1 << (i % 64);
            out.push(w);
        }
    }
}

/// The words of a [`pack_sparse`] message `msg` (at least
/// [`sparse_capacity`]`(words.len())` long), zeros where it has none.
pub(super) fn unpack_sparse(msg: &[u64], words: &mut [u64]) {
    let mut at = words.len().div_ceil(64);
    for (i, w) in words.iter_mut().enumerate() {
        *w = if msg[i / 64] >> (i % 64) & 1 == 1 {
            at += 1;
            msg[at - 1]
        } else {
            0
        };
    }
}

/// Words of one agreement message, on the stack for the default cache capacity (a
/// small op's cycle should not allocate).
pub(super) type Words = SmallVec<[u64; 144]>;

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
        idle: &mut dyn Idle,
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
        idle: &mut dyn Idle,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_messages_carry_every_word_and_only_the_non_zero_ones() {
        for len in [0usize, 1, 63, 64, 65, 89, 200] {
            let words: Vec<u64> = (0..len as u64)
                .map(|i| {
                    if i % 7 == 3 || i == 64 {
                        i * 0x1_0001 + 1
                    } else {
                        0
                    }
                })
                .collect();
            let mut packed = Words::new();
            pack_sparse(&words, &mut packed);
            let nonzero = words.iter().filter(|&&w| w != 0).count();
            assert_eq!(packed.len(), len.div_ceil(64) + nonzero, "len {len}");
            let mut msg = vec![u64::MAX; sparse_capacity(len)];
            msg[..packed.len()].copy_from_slice(&packed);
            let mut back = vec![u64::MAX; len];
            unpack_sparse(&msg, &mut back);
            assert_eq!(back, words, "len {len}");
        }
    }
}
