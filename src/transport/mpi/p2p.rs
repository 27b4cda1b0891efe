//! Point to point between two ranks (pipeline stages), outside the engine's cycles:
//! on a communicator of its own, a send posts a header (the tensor's name, dtype and
//! shape) and then the tensor's bytes, in pieces of at most `i32::MAX` bytes, all
//! non-blocking. A receive of the next header (from any rank, into a buffer of
//! [`P2P_HEADER_MAX`] bytes and the inline bytes) stays posted, so that a header lands
//! in it as it arrives: probing for headers instead costs MPI a pass through its queue
//! of unexpected messages and a second call to take the one found (0.53 µs one way
//! against 0.36 here under `MPI_THREAD_MULTIPLE`). A poll takes the headers received
//! (from any rank, in the order each rank sent them), posts the receives of their
//! bytes, and reports finished sends and whole tensors. Messages between a pair stay
//! in order (MPI does not overtake on one communicator and tag), so the bytes after a
//! header are that header's.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::*;
use crate::tensor::Tensor;
use crate::transport::{P2pEvent, P2pPort, P2P_HEADER_MAX};

/// The tags of headers and of data on the point-to-point communicator.
const HEADER_TAG: c_int = 21;
const DATA_TAG: c_int = 22;

/// The largest piece one MPI call carries (its count is a C int).
const PIECE: usize = i32::MAX as usize;

/// What precedes a tensor's bytes: the sender writes it from the tensor's own name
/// and shape (borrowed), the receiver reads it into owned ones.
#[derive(Serialize, Deserialize)]
struct Header<'a> {
    name: Cow<'a, str>,
    dtype: DType,
    shape: Cow<'a, [usize]>,
    /// The bytes follow the header in its own message (small tensors: one message
    /// instead of two, and no receive to post for the data).
    inline: bool,
    /// The sender's tensor was on a device (its bytes were copied to host memory to
    /// travel): the receiver puts it on its own device.
    device: bool,
}

/// Tensors up to this size travel inside their header's message.
const INLINE_BYTES: usize = 16 << 10;

/// The largest header message: a header and the bytes of a tensor inline.
const HEADER_MESSAGE_MAX: usize = P2P_HEADER_MAX + INLINE_BYTES;

/// A send in flight: its requests and the buffers they read.
struct Outgoing {
    id: u64,
    reqs: Vec<ffi::MPI_Request>,
    _header: Vec<u8>,
    tensor: Tensor,
}

/// A tensor being received: its requests write into `tensor`.
struct Incoming {
    src: usize,
    name: String,
    tensor: Tensor,
    reqs: Vec<ffi::MPI_Request>,
    /// Sent from a device ([`Header::device`]).
    from_device: bool,
}

/// The point-to-point side of a transport, which the engine keeps beside it.
pub(super) struct P2p {
    comm: SimpleCommunicator,
    next_id: u64,
    sends: Vec<Outgoing>,
    recvs: Vec<Incoming>,
    /// Tensors whose sends completed, kept to receive into (a pipeline stage sends and
    /// receives tensors of the same shapes; fresh memory costs a page fault per 4 KiB).
    spare: Vec<Tensor>,
    /// The receive of the next header, into `header_buf`, while posted.
    header_req: Option<ffi::MPI_Request>,
    /// Where headers are received ([`HEADER_MESSAGE_MAX`] bytes).
    header_buf: Vec<u8>,
    /// Test-only (feature fault-injection, `KOLO_FAULT_P2P_AS_DEVICE=1`): every tensor
    /// is sent as if from a device, so that a machine without one can check the
    /// receiving side's handling of it.
    #[cfg(feature = "fault-injection")]
    fault_as_device: bool,
    /// Test-only (feature fault-injection, `KOLO_FAULT_P2P_DATA_FAIL=<name>`): the
    /// send of that name fails after its header went out.
    #[cfg(feature = "fault-injection")]
    fault_data_fail: Option<String>,
    /// Destinations whose message stream broke: a send failed after its header went
    /// out, so the receiver would take the next send's bytes as that header's. Every
    /// later send there fails with why (issue 53 item 18).
    broken_to: Vec<(usize, String)>,
}

/// How many sent tensors [`P2p::spare`] keeps, and how many bytes in all.
const SPARE_TENSORS: usize = 8;
const SPARE_BYTES: usize = 1 << 30;

impl P2p {
    /// Point to point on `comm` (a duplicate of the transport's own communicator).
    pub(super) fn new(comm: SimpleCommunicator) -> Self {
        P2p {
            comm,
            next_id: 0,
            sends: Vec::new(),
            recvs: Vec::new(),
            spare: Vec::new(),
            header_req: None,
            header_buf: Vec::new(),
            #[cfg(feature = "fault-injection")]
            fault_as_device: std::env::var("KOLO_FAULT_P2P_AS_DEVICE").is_ok_and(|v| v == "1"),
            #[cfg(feature = "fault-injection")]
            fault_data_fail: std::env::var("KOLO_FAULT_P2P_DATA_FAIL").ok(),
            broken_to: Vec::new(),
        }
    }

    fn raw(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }
}

impl Drop for P2p {
    /// Requests still in flight must not read or write freed memory: receives are
    /// cancelled, and every request is waited for up to a second; the buffers of any
    /// still live after that are leaked rather than freed under MPI.
    fn drop(&mut self) {
        let mut header: Vec<ffi::MPI_Request> = self.header_req.take().into_iter().collect();
        for req in &mut header {
            // SAFETY: the live receive of the next header.
            unsafe { ffi::MPI_Cancel(req) };
        }
        for r in &mut self.recvs {
            for req in &mut r.reqs {
                // SAFETY: a live receive request of this port.
                unsafe { ffi::MPI_Cancel(req) };
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        let settled = |reqs: &mut Vec<ffi::MPI_Request>| loop {
            if all_done("MPI_Testall (drop)", reqs).unwrap_or(false) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        if !settled(&mut header) {
            std::mem::forget(std::mem::take(&mut self.header_buf));
        }
        for mut s in std::mem::take(&mut self.sends) {
            if !settled(&mut s.reqs) {
                std::mem::forget(s);
            }
        }
        for mut r in std::mem::take(&mut self.recvs) {
            if !settled(&mut r.reqs) {
                std::mem::forget(r);
            }
        }
    }
}

// SAFETY: as for `MpiTransport`: one thread at a time uses it (whoever holds the
// engine), MPI handles are plain values, and MPI runs at MPI_THREAD_MULTIPLE or is
// only called from the thread holding the engine.
unsafe impl Send for P2p {}

impl P2pPort for P2p {
    fn send(&mut self, dest: usize, name: &str, tensor: Tensor) -> Result<u64> {
        self.post_send(dest, name, tensor)
    }

    fn poll(&mut self, events: &mut Vec<P2pEvent>, drain: bool) -> Result<()> {
        self.poll_p2p(events, drain)
    }

    fn in_flight(&self) -> usize {
        let sends = self.sends.iter().map(|s| s.tensor.num_bytes());
        let recvs = self.recvs.iter().filter(|r| !r.reqs.is_empty());
        sends.sum::<usize>() + recvs.map(|r| r.tensor.num_bytes()).sum::<usize>()
    }
}

/// `tensor` in host memory: a device tensor is copied (waiting for the copy).
fn to_host(tensor: Tensor) -> Result<Tensor> {
    #[cfg(feature = "nccl")]
    if tensor.device().is_cuda() {
        return tensor.to_cpu().map_err(Error::from);
    }
    Ok(tensor)
}

/// Posts one non-blocking call per piece of the `len` bytes at `base`.
fn post_pieces(
    call: &'static str,
    base: *mut u8,
    len: usize,
    reqs: &mut Vec<ffi::MPI_Request>,
    mut post: impl FnMut(*mut u8, c_int, &mut ffi::MPI_Request) -> c_int,
) -> Result<()> {
    let mut at = 0;
    while at < len {
        let n = PIECE.min(len - at);
        let mut req = null_request();
        check(call, post(base.wrapping_add(at), count(call, n)?, &mut req))?;
        reqs.push(req);
        at += n;
    }
    Ok(())
}

/// Whether every request of `reqs` has completed (freed by MPI when it has).
fn all_done(call: &'static str, reqs: &mut [ffi::MPI_Request]) -> Result<bool> {
    if reqs.is_empty() {
        return Ok(true);
    }
    let mut flag: c_int = 0;
    // SAFETY: live requests of this transport's calls, whose buffers their owner keeps.
    check(call, unsafe {
        ffi::MPI_Testall(
            count(call, reqs.len())?,
            reqs.as_mut_ptr(),
            &mut flag,
            ffi::RSMPI_STATUSES_IGNORE,
        )
    })?;
    Ok(flag != 0)
}

impl P2p {
    /// Posts `tensor` to `dest` under `name`; see the module docs. The tensor stays
    /// here until the send completes, also after an error (requests already posted
    /// may still read it).
    pub(super) fn post_send(&mut self, dest: usize, name: &str, tensor: Tensor) -> Result<u64> {
        let call = "MPI_Isend (send)";
        if let Some((_, why)) = self.broken_to.iter().find(|(d, _)| *d == dest) {
            return Err(Error::Transport {
                call: "send",
                message: format!(
                    "{name:?} to rank {dest}: point to point to rank {dest} broke at an earlier \
                     send, which failed after its header went out ({why}); rank {dest} would \
                     take this send's bytes for that one, so nothing more is sent there"
                ),
            });
        }
        let device = tensor.device().is_cuda();
        #[cfg(feature = "fault-injection")]
        let device = device || self.fault_as_device;
        let tensor = to_host(tensor).map_err(|e| Error::Transport {
            call: "send",
            message: format!("{name:?} to rank {dest}: copying it to host memory to send: {e}"),
        })?;
        let inline = tensor.num_bytes() <= INLINE_BYTES;
        // Sized for the header and, inline, the bytes that follow it: one allocation.
        let room = name.len() + 10 * (tensor.shape().len() + 2) + 2;
        let room = room + if inline { tensor.num_bytes() } else { 0 };
        let mut header = postcard::to_extend(
            &Header {
                name: Cow::Borrowed(name),
                dtype: tensor.dtype(),
                shape: Cow::Borrowed(tensor.shape()),
                inline,
                device,
            },
            Vec::with_capacity(room),
        )
        .map_err(|e| Error::Internal(format!("send header: {e}")))?;
        if header.len() > P2P_HEADER_MAX {
            // Submit refuses longer names and more dimensions.
            return Err(Error::Internal(format!(
                "send {name:?}: a header of {} bytes (at most {P2P_HEADER_MAX})",
                header.len()
            )));
        }
        let peer = count(call, dest)?;
        let comm = self.raw();
        let (base, len) = {
            let b = tensor.as_bytes()?;
            if inline {
                header.extend_from_slice(b);
                (b.as_ptr().cast_mut(), 0)
            } else {
                (b.as_ptr().cast_mut(), b.len())
            }
        };
        let mut reqs = Vec::with_capacity(2);
        let posted = post_pieces(
            call,
            header.as_ptr().cast_mut(),
            header.len(),
            &mut reqs,
            |p, n, r| {
                // SAFETY: the header lives in `Outgoing` until the request completes.
                unsafe {
                    ffi::MPI_Isend(p.cast(), n, ffi::RSMPI_UINT8_T, peer, HEADER_TAG, comm, r)
                }
            },
        );
        let posted = match posted {
            Ok(()) => {
                let data = self.post_data(name, base, len, peer, &mut reqs);
                if let Err(e) = &data {
                    // The header is out: this stream is out of step for good.
                    self.broken_to.push((dest, e.to_string()));
                }
                data
            }
            Err(e) => Err(e),
        };
        let id = if posted.is_ok() {
            self.next_id
        } else {
            u64::MAX
        };
        self.next_id += 1;
        self.sends.push(Outgoing {
            id,
            reqs,
            _header: header,
            tensor,
        });
        posted.map(|()| id)
    }

    /// Posts the `len` bytes at `base` that follow a header to `peer`.
    fn post_data(
        &self,
        name: &str,
        base: *mut u8,
        len: usize,
        peer: c_int,
        reqs: &mut Vec<ffi::MPI_Request>,
    ) -> Result<()> {
        let call = "MPI_Isend (send)";
        #[cfg(feature = "fault-injection")]
        if len > 0 && self.fault_data_fail.as_deref() == Some(name) {
            return Err(Error::Transport {
                call,
                message: "injected failure after the header (KOLO_FAULT_P2P_DATA_FAIL)".into(),
            });
        }
        let _ = name;
        let comm = self.raw();
        post_pieces(call, base, len, reqs, |p, n, r| {
            // SAFETY: the tensor's heap bytes stay in `Outgoing` (moving the tensor does
            // not move them) until the request completes; MPI only reads them.
            unsafe { ffi::MPI_Isend(p.cast(), n, ffi::RSMPI_UINT8_T, peer, DATA_TAG, comm, r) }
        })
    }

    /// Keeps a sent tensor's memory for a later receive (the oldest goes first). Memory
    /// no receive can take (another framework's buffer, Burn's lent gradients and
    /// activations: the pipeline's sends) is let go at once instead of held.
    fn keep_spare(&mut self, t: Tensor) {
        if t.num_bytes() == 0 || t.num_bytes() > SPARE_BYTES || !t.reusable() {
            return;
        }
        self.spare.push(t);
        let mut total: usize = self.spare.iter().map(Tensor::num_bytes).sum();
        while self.spare.len() > SPARE_TENSORS || total > SPARE_BYTES {
            total -= self.spare.remove(0).num_bytes();
        }
    }

    /// Memory to receive a tensor of `dtype` and `shape` into: a spare of that size, or
    /// new.
    fn receive_buffer(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        // The most recently sent first: its memory is the likeliest still cached.
        match self
            .spare
            .iter_mut()
            .rposition(|t| t.reuse_as(dtype, shape))
        {
            Some(i) => Ok(self.spare.remove(i)),
            None => Tensor::try_zeros(dtype, shape),
        }
    }

    /// Progresses point to point; see the module docs.
    pub(super) fn poll_p2p(&mut self, events: &mut Vec<P2pEvent>, drain: bool) -> Result<()> {
        self.take_headers(drain)?;
        let call = "MPI_Testall (send)";
        let mut i = 0;
        while i < self.sends.len() {
            if all_done(call, &mut self.sends[i].reqs)? {
                let done = self.sends.remove(i);
                if done.id != u64::MAX {
                    events.push(P2pEvent::Sent(done.id));
                }
                self.keep_spare(done.tensor);
            } else {
                i += 1;
            }
        }
        let call = "MPI_Testall (recv)";
        let mut i = 0;
        // Tensors of one name from one source are handed on in the order they were
        // sent: a later one that completes first (a small one, inline) waits.
        let mut waiting: Vec<(usize, String)> = Vec::new();
        while i < self.recvs.len() {
            let r = &self.recvs[i];
            let behind = waiting.iter().any(|(s, n)| *s == r.src && *n == r.name);
            if !behind && all_done(call, &mut self.recvs[i].reqs)? {
                let done = self.recvs.remove(i);
                events.push(P2pEvent::Received {
                    src: done.src,
                    name: done.name,
                    tensor: done.tensor,
                    from_device: done.from_device,
                });
            } else {
                let r = &self.recvs[i];
                waiting.push((r.src, r.name.clone()));
                i += 1;
            }
        }
        Ok(())
    }

    /// Posts the receive of the next header, from any rank.
    fn post_header_recv(&mut self) -> Result<()> {
        self.header_buf.resize(HEADER_MESSAGE_MAX, 0);
        let mut req = null_request();
        let call = "MPI_Irecv (header)";
        // SAFETY: `header_buf` is not touched (nor resized) until the request
        // completes or is cancelled.
        check(call, unsafe {
            ffi::MPI_Irecv(
                self.header_buf.as_mut_ptr().cast(),
                count(call, HEADER_MESSAGE_MAX)?,
                ffi::RSMPI_UINT8_T,
                ffi::RSMPI_ANY_SOURCE,
                HEADER_TAG,
                self.raw(),
                &mut req,
            )
        })?;
        self.header_req = Some(req);
        Ok(())
    }

    /// Takes every header that has arrived (one, unless `drain`) and posts the
    /// receive of its bytes; posts the receive of the next header first if none is.
    fn take_headers(&mut self, drain: bool) -> Result<()> {
        loop {
            let mut req = match self.header_req {
                Some(req) => req,
                None => {
                    self.post_header_recv()?;
                    continue;
                }
            };
            let mut flag: c_int = 0;
            // SAFETY: a plain out-parameter.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: the live receive of the next header.
            check("MPI_Test (header)", unsafe {
                ffi::MPI_Test(&mut req, &mut flag, &mut status)
            })?;
            if flag == 0 {
                return Ok(());
            }
            self.header_req = None;
            let mut n: c_int = 0;
            // SAFETY: the status of the completed receive.
            check("MPI_Get_count (header)", unsafe {
                ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut n)
            })?;
            let buf = std::mem::take(&mut self.header_buf);
            let taken = self.take_header(to_usize(status.MPI_SOURCE), &buf[..to_usize(n)]);
            self.header_buf = buf;
            taken?;
            if !drain {
                // A caller waits for this tensor: it gets it before the next header's
                // receive is posted (at the next poll; a header arriving meanwhile
                // waits in MPI's queue and lands in that receive): 0.63 -> 0.59 µs one
                // way. Testing again would find nothing as often as not, and Open MPI
                // yields the core on a test that finds nothing (`mpi_yield_when_idle`).
                return Ok(());
            }
        }
    }

    /// Takes the header `buf` from `src`: a tensor inline is whole; otherwise posts
    /// the receive of its bytes.
    fn take_header(&mut self, src: usize, buf: &[u8]) -> Result<()> {
        let (header, rest): (Header, &[u8]) =
            postcard::take_from_bytes(buf).map_err(|e| Error::Transport {
                call: "recv",
                message: format!("a malformed point-to-point header from rank {src}: {e}"),
            })?;
        // The header's shape is another process's word: its size is checked against
        // the bytes that came inline before anything is allocated, and a size that
        // cannot be allocated is an error, not an abort.
        let bytes = crate::tensor::checked_len(&header.shape, header.dtype)
            .map(|n| n * header.dtype.size_of())
            .map_err(|_| Error::Transport {
                call: "recv",
                message: format!(
                    "rank {src} sent a header for {:?} of shape {:?} ({:?}), which overflows",
                    header.name, header.shape, header.dtype
                ),
            })?;
        if header.inline && bytes != rest.len() {
            return Err(Error::Transport {
                call: "recv",
                message: format!(
                    "rank {src} sent {} bytes for {:?} of shape {:?}",
                    rest.len(),
                    header.name,
                    header.shape
                ),
            });
        }
        let mut tensor = self.receive_buffer(header.dtype, &header.shape)?;
        if header.inline {
            // As many bytes as the header's shape takes: checked above.
            tensor.as_bytes_mut()?.copy_from_slice(rest);
            self.recvs.push(Incoming {
                src,
                name: header.name.into_owned(),
                tensor,
                reqs: Vec::new(),
                from_device: header.device,
            });
            return Ok(());
        }
        let mut reqs = Vec::with_capacity(1);
        let comm = self.raw();
        let peer = count("MPI_Irecv (recv)", src)?;
        let bytes = tensor.as_bytes_mut()?;
        let (base, len) = (bytes.as_mut_ptr(), bytes.len());
        let posted = post_pieces("MPI_Irecv (recv)", base, len, &mut reqs, |p, n, r| {
            // SAFETY: the tensor's heap bytes stay in `Incoming` until the request
            // completes; nothing else touches them meanwhile.
            unsafe { ffi::MPI_Irecv(p.cast(), n, ffi::RSMPI_UINT8_T, peer, DATA_TAG, comm, r) }
        });
        // Kept also after a failed post: pieces already posted write into it.
        self.recvs.push(Incoming {
            src,
            name: header.name.into_owned(),
            tensor,
            reqs,
            from_device: header.device,
        });
        // A failure here leaves this source's data stream out of step with its
        // headers: the caller fails the whole lane (see `P2pLane::poll`).
        posted
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::{DType, Header};

    #[test]
    fn a_header_written_from_borrowed_parts_reads_back_whole() {
        let shape = [3usize, 0, 70_000];
        let bytes = postcard::to_extend(
            &Header {
                name: Cow::Borrowed("grad.7"),
                dtype: DType::BF16,
                shape: Cow::Borrowed(&shape),
                inline: true,
                device: true,
            },
            Vec::new(),
        )
        .unwrap();
        let back: Header = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.name, "grad.7");
        assert_eq!(&*back.shape, &shape[..]);
        assert_eq!(
            (back.dtype, back.inline, back.device),
            (DType::BF16, true, true)
        );
    }
}
