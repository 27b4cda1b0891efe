//! The sum rings over point-to-point messages: one buffer (`ring_allreduce`,
//! pipelined in segments on one host), or several at once in one message per step
//! (`ring_allreduce_many`, where every hop crosses hosts). The chunk arithmetic is in
//! `transport/ring.rs`; the thresholds that choose a ring are measured below.

use std::ffi::c_int;
use std::mem::MaybeUninit;

use mpi::ffi;

use super::group::Group;
use super::types::{check, count, datatype, null_request, per_rank, sized};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::transport::ring::{add_into, chunk, send_chunk};

/// Sums at least this large use the segmented ring instead of MPI_Allreduce, on one
/// host. Measured there (Open MPI 4.1.4, 2 cores), ten in-place f32 sums per size,
/// both ways in the same run, ring time / MPI_Allreduce time: np 2: 1.01–1.08 at
/// 1 MiB, 0.98–1.06 from 2.25 to 28 MiB, 0.58–0.59 at 32 MiB; np 4: 0.91–0.98 at
/// 1 MiB, 0.94–1.25 from 2.25 to 20 MiB, 1.00–1.06 at 24–28 MiB, 0.53–0.55 at 32 MiB.
/// Open MPI's own algorithm slows down between 28 and 32 MiB here; below that the ring
/// gains nothing.
pub(super) const RING_MIN_BYTES_ONE_HOST: usize = 32 << 20;

/// The same threshold when the job spans hosts. Measured across 2 emulated hosts × 1
/// rank (TCP over veth, `scripts/multinode`), ResNet-50 gradient set, kolo with the
/// ring from this size / plain MPI program's per-tensor loop: at 10 Gbit/s, 0.90–0.93
/// from 256 KiB or 1 MiB, 1.07–1.10 from 4 MiB, 1.26–1.38 from 32 MiB (blocking
/// segment exchanges); the windowed ring below from 1 MiB: 0.95–0.98 at 10 Gbit/s,
/// 0.94–1.02 at 1 Gbit/s. Open MPI's TCP allreduce leaves the link idle between its
/// phases; the ring keeps both directions busy.
pub(super) const RING_MIN_BYTES_HOSTS: usize = 1 << 20;

/// Sum reduce-scatters at least this large go around the ring instead of
/// `MPI_Reduce_scatter`, on one host. Measured there (Open MPI 4.1, 2 cores), f32 sums
/// through kolo's `reducescatter`, p50 of 20–200 per size, two launches each way,
/// ring / `MPI_Reduce_scatter`: np 2: 0.31–0.56 at 256 KiB, 0.84–1.2 at 1 MiB,
/// 0.72–0.78 at 4 MiB, 0.54–0.86 at 16 MiB, 0.35 at 40 MiB; np 4: 0.43–0.51 at
/// 256 KiB, 0.86–0.89 at 1 MiB, 0.57–0.77 at 4 MiB, 0.51–0.65 at 16 MiB, 0.37–0.51 at
/// 40 MiB. Smaller sizes were not measured.
pub(super) const RING_REDUCE_SCATTER_MIN_BYTES: usize = 256 << 10;

/// Segment size of the ring on one host: bounds the reused scratch buffers and
/// pipelines copies. Across hosts each step's chunk is one message instead (scratch of
/// one chunk). Measured across 2 emulated hosts × 1 rank, one 64 MiB f32 sum, ring ÷
/// a plain MPI program's MPI_Allreduce (alternating launches): at 1 Gbit/s, one
/// message per chunk 1.00 (570 ms, line rate); 256 KiB segments, 4 in flight: 1.42–1.46
/// (820–834 ms), and no better with 32 or 64 KiB segments 32 or 64 in flight, or
/// 2, 4, 8 MiB segments one at a time (1.25–1.83). At 10 Gbit/s every variant beat
/// MPI_Allreduce: one message 0.82–0.93 (68–71 ms), 256 KiB × 4 0.87 (66–67 ms). So
/// do the hierarchical allreduce's cross-host ring and a flat ring of one rank per host
/// (2 × 2 hierarchical, ResNet-50 set at 10 Gbit/s: 195–201 ms vs 219–224 with
/// segments). A flat ring with several ranks per host keeps the segments: at 2 × 2 its
/// one-message form was 8–13 % slower at 10 Gbit/s (196–210 vs 179–186 ms) and level
/// at 1 Gbit/s (1321–1327 vs 1344–1381 ms). Each
/// message is a rendezvous whose acknowledgement queues behind the other direction's
/// data; a TCP link with a short queue (the emulation's tbf: 5 ms) then idles between
/// segments or drops packets when many are in flight.
pub(super) const RING_SEGMENT_BYTES: usize = 256 << 10;

/// Segments received ahead of the one being added (scratch buffers in use): the
/// network keeps receiving while a segment is summed.
const RING_WINDOW: usize = 4;

/// Non-blocking requests of one ring step, completed together.
struct Requests(Vec<ffi::MPI_Request>);

impl Requests {
    const CALL: &'static str = "MPI_Waitall (ring allreduce)";

    /// Waits for every request (blocking: the data plane runs once all ranks are ready).
    fn wait_all(&mut self) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let n = count(Self::CALL, self.0.len())?;
        // SAFETY: every request came from MPI_Isend/MPI_Irecv on buffers the ring keeps
        // alive and untouched until this returns.
        let rc = unsafe { ffi::MPI_Waitall(n, self.0.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
        self.0.clear();
        check(Self::CALL, rc)
    }

    fn post(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let mut req = null_request();
        check(call, f(&mut req))?;
        self.0.push(req);
        Ok(())
    }

    /// Waits for request `i` only (then MPI_REQUEST_NULL, which wait_all skips).
    fn wait(&mut self, i: usize) -> Result<()> {
        // SAFETY: as in `wait_all`.
        check(Self::CALL, unsafe {
            ffi::MPI_Wait(&mut self.0[i], ffi::RSMPI_STATUS_IGNORE)
        })
    }
}

impl Drop for Requests {
    /// A step left early (an MPI error) must not let MPI write into a buffer the caller
    /// gets back: finish what is in flight first.
    fn drop(&mut self) {
        let _ = self.wait_all();
    }
}

/// In-place segmented ring allreduce (sum) over non-blocking point-to-point
/// messages, with reused scratch segments: Open MPI allocates about half the
/// message as scratch on every large MPI_Allreduce; this allocates nothing after
/// the first call. With `segment` bytes, in each reduce-scatter step up to
/// `RING_WINDOW` segments are in flight each way: a segment is summed while the next
/// ones arrive, and a new send and receive are posted as each completes (posting
/// every send at once was slower: the receiver then handles unexpected rendezvous
/// messages). With None (across hosts) each step's chunk is one message, received
/// into a chunk of scratch (see `RING_SEGMENT_BYTES`). The allgather receives
/// straight into the buffer.
///
/// `order[i]` is the rank of `g` at ring position `i`; this rank is at `pos`.
/// `scratch` is kept between calls.
pub(super) fn ring_allreduce(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    dtype: DType,
    segment: Option<usize>,
) -> Result<()> {
    ring_allreduce_with(g, order, pos, scratch, buf, dtype, segment, &mut |_| Ok(()))
}

/// [`ring_allreduce`] that hands the chunk this rank has summed to `between` once the
/// reduce-scatter is done (no message in flight then), before the allgather passes it
/// on: the hierarchical allreduce sums it across hosts there.
#[allow(clippy::too_many_arguments)]
pub(super) fn ring_allreduce_with(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    dtype: DType,
    segment: Option<usize>,
    between: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let links = Links::new(g, order, pos, dtype, RING_SEND, RING_RECV)?;
    let (n, es) = (links.n, links.es);
    let len = buf.len() / es;
    let starts = (0..n).map(|c| chunk(len, n, c).0).chain([len]).collect();
    let ring = Ring::new(links, starts, buf, scratch, segment)?;
    (|| {
        let mut sends = Requests(Vec::new());
        let mut recvs = Requests(Vec::new());
        // Reduce-scatter: after n - 1 steps this rank holds the full sum of one chunk.
        for step in 0..n - 1 {
            ring.reduce_step(step, &mut sends, &mut recvs)?;
        }
        let (oa, ob) = ring.chunk(n - 1);
        // SAFETY: [oa, ob) is this rank's chunk of `buf`; every request has completed.
        between(unsafe { std::slice::from_raw_parts_mut(ring.base.add(oa * es), (ob - oa) * es) })?;
        // Allgather: each summed chunk travels once around the ring.
        for step in 0..n - 1 {
            let (ra, rb) = ring.chunk(step + n);
            ring.irecv(&mut recvs, ring.base.wrapping_add(ra * es), rb - ra)?;
            ring.isend(&mut sends, ring.chunk(step + n - 1))?;
            recvs.wait_all()?;
            sends.wait_all()?;
        }
        Ok(())
    })()
}

/// Reduce-scatters `buf` (a sum, in place: `buf` is scratch afterwards) around the
/// ring of the ranks in their order, block `r` of `counts` to rank `r`, into `recv`:
/// the reduce-scatter half of [`ring_allreduce`], its chunks the blocks and every step
/// one later, so that each rank ends holding its own block. Open MPI's
/// `MPI_Reduce_scatter` took 70–75 ms for 40 MiB at np 2 here (the sharded optimizer's
/// gradients of the 10 M-parameter MLP), this ring 24–26 ms
/// ([`RING_REDUCE_SCATTER_MIN_BYTES`]).
pub(super) fn ring_reduce_scatter(
    g: Group,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    recv: &mut [MaybeUninit<u8>],
    counts_: &[usize],
    dtype: DType,
    segment: Option<usize>,
) -> Result<()> {
    const CALL: &str = "MPI_Isend/MPI_Irecv (ring reduce-scatter)";
    per_rank(CALL, counts_, g.size)?;
    sized(CALL, "send", buf.len(), counts_.iter().sum(), dtype)?;
    sized(CALL, "receive", recv.len(), counts_[g.rank], dtype)?;
    let order: Vec<usize> = (0..g.size).collect();
    let links = Links::new(g, &order, g.rank, dtype, RING_SEND, RING_RECV)?;
    let (n, es) = (links.n, links.es);
    let starts = std::iter::once(0)
        .chain(counts_.iter().scan(0, |at, &c| {
            *at += c;
            Some(*at)
        }))
        .collect();
    let ring = Ring::new(links, starts, buf, scratch, segment)?;
    {
        let mut sends = Requests(Vec::new());
        let mut recvs = Requests(Vec::new());
        // Steps 1..n instead of 0..n-1: rank r's last sum is block r, not r + 1; that
        // sum is written straight into `recv` (no copy of the block afterwards).
        for step in 1..n {
            let into = (step == n - 1).then_some(&mut *recv);
            ring.reduce_step_into(step, &mut sends, &mut recvs, into)?;
        }
    }
    if n == 1 {
        let (a, b) = (ring.starts[g.rank], ring.starts[g.rank + 1]);
        write_copy(recv, &buf[a * es..b * es]);
    }
    Ok(())
}

/// Copies `src` into `dst` (the same length), which is then initialised.
fn write_copy<'a>(dst: &'a mut [MaybeUninit<u8>], src: &[u8]) -> &'a mut [u8] {
    assert_eq!(dst.len(), src.len(), "write_copy: lengths differ");
    // SAFETY: both hold `src.len()` bytes and do not overlap (`dst` is borrowed
    // mutably); after the copy every byte of `dst` is initialised.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len());
        crate::transport::assume_written(dst)
    }
}

/// What both sum rings share: the ring's size and this rank's position in it, its
/// neighbours as MPI ranks, the communicator and the element type.
#[derive(Clone, Copy)]
struct Links {
    n: usize,
    /// This rank's position in the ring.
    r: usize,
    right: c_int,
    left: c_int,
    ty: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    dtype: DType,
    /// Bytes per element.
    es: usize,
}

impl Links {
    /// The links of ring position `pos` in `order` over `g`; `send` and `recv` name the
    /// calls in an error.
    fn new(
        g: Group,
        order: &[usize],
        pos: usize,
        dtype: DType,
        send: &'static str,
        recv: &'static str,
    ) -> Result<Links> {
        let (right, left) = ring_neighbours(order, pos, send, recv)?;
        Ok(Links {
            n: g.size,
            r: pos,
            right,
            left,
            ty: datatype(dtype),
            comm: g.comm,
            dtype,
            es: dtype.size_of(),
        })
    }
}

const RING_SEND: &str = "MPI_Isend (ring allreduce)";
const RING_RECV: &str = "MPI_Irecv (ring allreduce)";

/// One rank's sum ring over one buffer. Once messages are in flight the buffer is
/// reached only through `base` (an in-flight send reads one chunk while the sum
/// writes another), the scratch only through `slots`.
struct Ring {
    links: Links,
    /// Where each chunk starts (elements), and the buffer's length last.
    starts: Vec<usize>,
    base: *mut u8,
    slots: *mut u8,
    /// Elements per segment, and segments in flight each way.
    seg: usize,
    window: usize,
}

impl Ring {
    /// The ring over `buf`, cut into chunks at `starts` (and its length last), with
    /// `segment`-byte segments in flight (None: each step's chunk as one message) in
    /// `scratch`, resized to what they need. The largest chunk's count is checked here,
    /// so that none fails once messages are in flight.
    fn new(
        links: Links,
        starts: Vec<usize>,
        buf: &mut [u8],
        scratch: &mut Vec<u8>,
        segment: Option<usize>,
    ) -> Result<Ring> {
        let es = links.es;
        let largest = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        count(RING_SEND, largest)?;
        let (seg, window) = match segment {
            Some(bytes) => ((bytes / es).max(1), RING_WINDOW),
            None => (largest.max(1), 1),
        };
        scratch.resize(window * seg * es, 0);
        Ok(Ring {
            starts,
            links,
            base: buf.as_mut_ptr(),
            slots: scratch.as_mut_ptr(),
            seg,
            window,
        })
    }

    /// The element range of the chunk this rank sends at `step`.
    fn chunk(&self, step: usize) -> (usize, usize) {
        let c = send_chunk(self.links.r, step, self.links.n);
        (self.starts[c], self.starts[c + 1])
    }

    /// Scratch slot `k` (of `window`, reused in turn).
    fn slot(&self, k: usize) -> *mut u8 {
        self.slots
            .wrapping_add((k % self.window) * self.seg * self.links.es)
    }

    /// Element ranges [a, b) of a chunk cut into segments.
    fn segments(&self, (a, b): (usize, usize)) -> Vec<(usize, usize)> {
        (a..b)
            .step_by(self.seg)
            .map(|s| (s, (s + self.seg).min(b)))
            .collect()
    }

    fn isend(&self, reqs: &mut Requests, (a, b): (usize, usize)) -> Result<()> {
        // SAFETY: [a, b) lies in the buffer (a chunk range), which nothing writes until
        // this request completes; b - a fits in c_int (the largest chunk does).
        reqs.post(RING_SEND, |req| unsafe {
            ffi::MPI_Isend(
                self.base.add(a * self.links.es).cast_const().cast(),
                (b - a) as c_int,
                self.links.ty,
                self.links.right,
                7,
                self.links.comm,
                req,
            )
        })
    }

    fn irecv(&self, reqs: &mut Requests, into: *mut u8, elems: usize) -> Result<()> {
        // SAFETY: `into` is valid for `elems` elements (a scratch slot, or a chunk
        // range of the buffer) and nothing reads or writes it until this request
        // completes; `elems` fits in c_int (at most one chunk).
        reqs.post(RING_RECV, |req| unsafe {
            ffi::MPI_Irecv(
                into.cast(),
                elems as c_int,
                self.links.ty,
                self.links.left,
                7,
                self.links.comm,
                req,
            )
        })
    }

    /// One reduce-scatter step: this rank's outgoing chunk goes right while the left
    /// neighbour's arrives, segment by segment, and is added into the buffer.
    fn reduce_step(&self, step: usize, sends: &mut Requests, recvs: &mut Requests) -> Result<()> {
        self.reduce_step_into(step, sends, recvs, None)
    }

    /// [`reduce_step`](Self::reduce_step), the sums of the incoming chunk written into
    /// `into` (the chunk's length) instead of over the buffer when given.
    fn reduce_step_into(
        &self,
        step: usize,
        sends: &mut Requests,
        recvs: &mut Requests,
        mut into: Option<&mut [MaybeUninit<u8>]>,
    ) -> Result<()> {
        let out = self.segments(self.chunk(step));
        let (first, _) = self.chunk(step + 1);
        let inc = self.segments(self.chunk(step + 1));
        let window = self.window;
        for k in 0..window {
            if let Some(&s) = out.get(k) {
                self.isend(sends, s)?;
            }
            if let Some(&(a, b)) = inc.get(k) {
                self.irecv(recvs, self.slot(k), b - a)?;
            }
        }
        for k in 0..out.len().max(inc.len()) {
            if let Some(&(a, b)) = inc.get(k) {
                recvs.wait(k)?;
                let bytes = (b - a) * self.links.es;
                // SAFETY: the slot holds the segment just received and no receive into
                // it is posted until after the sum; [a, b) is in the incoming chunk,
                // which no in-flight send reads.
                let (acc, got) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(self.base.add(a * self.links.es), bytes),
                        std::slice::from_raw_parts(self.slot(k), bytes),
                    )
                };
                match into.as_deref_mut() {
                    Some(dst) => {
                        let at = (a - first) * self.links.es;
                        let dst = write_copy(&mut dst[at..at + bytes], acc);
                        add_into(dst, got, self.links.dtype);
                    }
                    None => add_into(acc, got, self.links.dtype),
                }
                if let Some(&(na, nb)) = inc.get(k + window) {
                    self.irecv(recvs, self.slot(k + window), nb - na)?;
                }
            }
            if k < out.len() {
                sends.wait(k)?;
                if let Some(&s) = out.get(k + window) {
                    self.isend(sends, s)?;
                }
            }
        }
        recvs.0.clear();
        sends.wait_all()
    }
}

/// The ranks this ring position sends to (the next position) and receives from (the
/// previous one), as MPI counts; `send` and `recv` name the calls in an error.
fn ring_neighbours(
    order: &[usize],
    pos: usize,
    send: &'static str,
    recv: &'static str,
) -> Result<(c_int, c_int)> {
    let n = order.len();
    Ok((
        count(send, order[(pos + 1) % n])?,
        count(recv, order[(pos + n - 1) % n])?,
    ))
}

/// Below this rate between hosts (bytes/s per rank, as [`super::MpiTransport::probe_link`]
/// times it) large sums go through the ring in groups. Across 2 emulated hosts with one
/// rank each, ResNet-50 gradient set: at 1 Gbit/s (timed at 0.65-0.93 Gbit/s) grouping
/// is 1.3× faster (870 vs 1120-1180 ms per step, as fast as one pre-packed
/// MPI_Allreduce); at 10 Gbit/s (timed at 7.1-7.9; unshaped, 9.5-9.7) it is 1.2-1.4×
/// slower, because MPI gathers each step's message from the tensors with copies, and
/// the emulated hosts share two cores with their TCP stacks.
pub(super) const GROUPED_RING_BELOW_BYTES_PER_S: f64 = 2e9 / 8.0;

/// The bytes each rank sends per probe of the link between hosts.
pub(super) const PROBE_BYTES: usize = 4 << 20;

/// The most bytes of large tensors one [`ring_allreduce_many`] takes (Horovod's fusion
/// threshold); its scratch is the group's size over the number of ranks.
pub(super) const IN_PLACE_GROUP_BYTES: usize = 128 << 20;

/// The sum ring of [`ring_allreduce`] over several buffers at once, each in place: at
/// every step one message carries the chunk of every buffer (an MPI datatype of blocks
/// at their addresses, so nothing is copied into a fusion buffer first), and the
/// received chunks land end to end in scratch before they are added in. Where each
/// hop crosses hosts, a tensor's own ring leaves the link idle between its steps and
/// between tensors; a group's ring streams like one pre-packed message. One message
/// per step rather than one per buffer: with many rendezvous messages in flight both
/// ways, each side's clear-to-send replies queue behind its own data, and the two
/// directions can end up taking turns (measured: the ResNet-50 set at 1 Gbit/s took
/// 860 or 1700 ms per step from one launch to the next). Each buffer's chunks and
/// summation order are those of its own ring, so all ranks end bit-identical.
pub(super) fn ring_allreduce_many(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    bufs: &mut [&mut [u8]],
    dtype: DType,
) -> Result<()> {
    let links = Links::new(g, order, pos, dtype, MANY_SEND, MANY_RECV)?;
    let (n, es) = (links.n, links.es);
    let lens: Vec<usize> = bufs.iter().map(|b| b.len() / es).collect();
    // A buffer's first chunk is its largest: their sum bounds every step's message,
    // checked once here so that no count fails once messages are in flight.
    let largest: usize = lens.iter().map(|&len| chunk(len, n, 0).1).sum();
    count(MANY_RECV, largest)?;
    scratch.resize(largest * es, 0);
    let bases: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let ring = ManyRing {
        links,
        origin: bases.iter().copied().min().unwrap_or(std::ptr::null_mut()),
        bases,
        lens,
        slots: scratch.as_mut_ptr(),
    };
    (|| {
        let mut sends = Requests(Vec::new());
        let mut recvs = Requests(Vec::new());
        for step in 0..n - 1 {
            ring.reduce_step(step, &mut sends, &mut recvs)?;
        }
        // Allgather: each summed chunk travels once around the ring, straight into
        // its buffer.
        for step in 0..n - 1 {
            let into = ring.blocks(MANY_RECV, step + n)?;
            let from = ring.blocks(MANY_SEND, step + n - 1)?;
            // SAFETY: the datatype's blocks are the chunks of the buffers this step
            // fills, which nothing else reads or writes until the receive completes.
            recvs.post(MANY_RECV, |req| unsafe {
                ffi::MPI_Irecv(
                    ring.origin.cast(),
                    1,
                    into.0,
                    links.left,
                    7,
                    links.comm,
                    req,
                )
            })?;
            // SAFETY: the blocks are chunks of the buffers, which nothing writes until
            // this send completes.
            sends.post(MANY_SEND, |req| unsafe {
                ffi::MPI_Isend(
                    ring.origin.cast_const().cast(),
                    1,
                    from.0,
                    links.right,
                    7,
                    links.comm,
                    req,
                )
            })?;
            recvs.wait_all()?;
            sends.wait_all()?;
        }
        Ok(())
    })()
}

const MANY_SEND: &str = "MPI_Isend (grouped ring allreduce)";
const MANY_RECV: &str = "MPI_Irecv (grouped ring allreduce)";

/// One rank's sum ring over several buffers. Once messages are in flight the
/// buffers are reached only through `bases` (an in-flight send reads one chunk of a
/// buffer while the sum writes another), the scratch only through `slots`.
struct ManyRing {
    links: Links,
    /// Each buffer's start and element count; the lowest start.
    bases: Vec<*mut u8>,
    lens: Vec<usize>,
    origin: *mut u8,
    slots: *mut u8,
}

impl ManyRing {
    /// The chunk of a buffer of `len` elements this rank sends at `step`.
    fn chunk(&self, len: usize, step: usize) -> (usize, usize) {
        chunk(
            len,
            self.links.n,
            send_chunk(self.links.r, step, self.links.n),
        )
    }

    /// The chunks this rank sends at `step`, of every buffer, as one datatype at
    /// `origin`.
    fn blocks(&self, call: &'static str, step: usize) -> Result<Blocks> {
        let parts: Vec<(usize, usize)> = self
            .bases
            .iter()
            .zip(&self.lens)
            .map(|(&base, &len)| {
                let (a, b) = self.chunk(len, step);
                (
                    base as usize - self.origin as usize + a * self.links.es,
                    b - a,
                )
            })
            .collect();
        Blocks::new(call, self.links.ty, &parts)
    }

    /// One reduce-scatter step: every buffer's outgoing chunk goes right in one
    /// message while the left neighbour's chunks land end to end in scratch, then are
    /// added into their buffers.
    fn reduce_step(&self, step: usize, sends: &mut Requests, recvs: &mut Requests) -> Result<()> {
        let outgoing = self.blocks(MANY_SEND, step)?;
        let elems: usize = self
            .lens
            .iter()
            .map(|&len| self.chunk(len, step + 1))
            .map(|(a, b)| b - a)
            .sum();
        // SAFETY: the scratch holds the largest step's elements, at least `elems`, and
        // nothing touches it until the receive completes; `elems` fits in c_int.
        recvs.post(MANY_RECV, |req| unsafe {
            ffi::MPI_Irecv(
                self.slots.cast(),
                elems as c_int,
                self.links.ty,
                self.links.left,
                7,
                self.links.comm,
                req,
            )
        })?;
        // SAFETY: the datatype's blocks are chunks of the buffers, which nothing
        // writes until this send completes.
        sends.post(MANY_SEND, |req| unsafe {
            ffi::MPI_Isend(
                self.origin.cast_const().cast(),
                1,
                outgoing.0,
                self.links.right,
                7,
                self.links.comm,
                req,
            )
        })?;
        recvs.wait_all()?;
        let mut at = 0;
        for (&base, &len) in self.bases.iter().zip(&self.lens) {
            let (a, b) = self.chunk(len, step + 1);
            let bytes = (b - a) * self.links.es;
            // SAFETY: the scratch at `at` holds this buffer's incoming chunk, just
            // received; [a, b) is that chunk of the buffer, which no in-flight send
            // reads.
            let (acc, got) = unsafe {
                (
                    std::slice::from_raw_parts_mut(base.add(a * self.links.es), bytes),
                    std::slice::from_raw_parts(self.slots.add(at), bytes),
                )
            };
            add_into(acc, got, self.links.dtype);
            at += bytes;
        }
        sends.wait_all()
    }
}

/// A committed MPI datatype of blocks of one element type at byte offsets (one
/// message over several buffers, without copying them together); freed on drop.
struct Blocks(ffi::MPI_Datatype);

impl Blocks {
    /// Blocks of `(byte offset, elements)` of `ty`.
    fn new(call: &'static str, ty: ffi::MPI_Datatype, parts: &[(usize, usize)]) -> Result<Blocks> {
        let n = count(call, parts.len())?;
        let lens = parts
            .iter()
            .map(|&(_, elems)| count(call, elems))
            .collect::<Result<Vec<c_int>>>()?;
        let offsets = parts
            .iter()
            .map(|&(at, _)| {
                ffi::MPI_Aint::try_from(at)
                    .map_err(|_| Error::Internal(format!("{call}: offset {at} out of range")))
            })
            .collect::<Result<Vec<ffi::MPI_Aint>>>()?;
        let mut t = ty;
        // SAFETY: `lens` and `offsets` hold `n` entries each; `t` receives the new type.
        check(call, unsafe {
            ffi::MPI_Type_create_hindexed(n, lens.as_ptr(), offsets.as_ptr(), ty, &mut t)
        })?;
        let mut blocks = Blocks(t);
        // SAFETY: a type just created, committed once.
        check(call, unsafe { ffi::MPI_Type_commit(&mut blocks.0) })?;
        Ok(blocks)
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        // SAFETY: a type this struct created; MPI lets operations that use it finish.
        unsafe {
            ffi::MPI_Type_free(&mut self.0);
        }
    }
}
