//! Runs a plan of `transport/schedule.rs` (the pipelined hierarchical allreduce)
//! over MPI: each lane's round is posted as non-blocking messages on the host's or
//! the cross-host communicator; `MPI_Waitsome` returns whichever complete, a lane
//! whose round has fully arrived adds what it received and posts its next round, and
//! a new lane starts when `schedule::may_start` lets it. While this rank waits, every
//! lane's messages progress at once: one piece crosses hosts while the next is
//! summed inside the host.

use std::ffi::c_int;

use mpi::ffi;

use super::group::Group;
use super::types::{check, count, datatype, null_request};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::transport::ring::add_into;
use crate::transport::schedule::{may_start, Lane, Level, Msg, WINDOW};

const CALL: &str = "MPI_Isend/MPI_Irecv/MPI_Waitsome (pipelined hierarchical allreduce)";

/// Requests in flight and the lane each belongs to. Dropping it waits for them, so
/// that no message is written into a buffer after an error returned it.
struct InFlight {
    reqs: Vec<ffi::MPI_Request>,
    lane: Vec<usize>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(n) = count(CALL, self.reqs.len()) {
            if n > 0 {
                // SAFETY: every request came from MPI_Isend/MPI_Irecv on buffers the
                // caller keeps alive until this returns.
                let _ = unsafe {
                    ffi::MPI_Waitall(n, self.reqs.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE)
                };
            }
        }
    }
}

/// Runs `lanes` over `buf` (`local` and `cross`: the levels' groups), every lane's
/// received chunks in its slot of `scratch` (resized here).
pub(super) fn run(
    levels: (Group, Group),
    lanes: &[Lane],
    buf: &mut [u8],
    scratch: &mut Vec<u8>,
    dtype: DType,
) -> Result<()> {
    let slot = lanes.iter().map(|l| l.scratch).max().unwrap_or(0);
    scratch.clear();
    scratch.resize(slot * WINDOW, 0);
    // Every message must fit an MPI count and its buffer before any is posted.
    for m in lanes
        .iter()
        .flat_map(|l| &l.rounds)
        .flat_map(|r| r.sends.iter().chain(&r.recvs))
    {
        count(CALL, m.len / dtype.size_of())?;
        if m.at + m.len > if m.to_scratch { slot } else { buf.len() } {
            return Err(Error::Internal(format!(
                "pipelined allreduce: a message of {} bytes at {} lies outside its buffer",
                m.len, m.at
            )));
        }
    }
    let mut run = Run {
        levels,
        lanes,
        dtype,
        base: buf.as_mut_ptr(),
        slots: scratch.as_mut_ptr(),
        slot,
        done: vec![0; lanes.len()],
        pending: vec![0; lanes.len()],
        started: 0,
        flight: InFlight {
            reqs: Vec::new(),
            lane: Vec::new(),
        },
    };
    loop {
        while run.started < lanes.len() && may_start(lanes, &run.done, run.started) {
            run.post(run.started)?;
            run.started += 1;
        }
        if run.flight.reqs.is_empty() {
            if run
                .done
                .iter()
                .zip(lanes)
                .all(|(&d, l)| d == l.rounds.len())
            {
                return Ok(());
            }
            return Err(Error::Internal(
                "pipelined allreduce: lanes left unfinished with nothing in flight".into(),
            ));
        }
        for i in run.wait_some()? {
            run.finish_round(i)?;
        }
    }
}

/// A plan being run: the lanes, how many rounds each has completed and how many of
/// its current round's messages are still in flight.
struct Run<'a> {
    levels: (Group, Group),
    lanes: &'a [Lane],
    dtype: DType,
    /// The buffer and the scratch, reached only through these once messages fly.
    base: *mut u8,
    slots: *mut u8,
    /// Bytes of one lane's scratch slot.
    slot: usize,
    done: Vec<usize>,
    pending: Vec<usize>,
    /// Lanes started so far (in order).
    started: usize,
    flight: InFlight,
}

impl Run<'_> {
    /// Lane `i`'s scratch slot.
    fn slot_of(&self, i: usize) -> *mut u8 {
        self.slots.wrapping_add((i % WINDOW) * self.slot)
    }

    /// Posts lane `i`'s current round.
    fn post(&mut self, i: usize) -> Result<()> {
        let r = &self.lanes[i].rounds[self.done[i]];
        let (local, cross) = self.levels;
        let slot = self.slot_of(i);
        let msgs = r.recvs.iter().map(|m| (m, false));
        for (m, send) in msgs.chain(r.sends.iter().map(|m| (m, true))) {
            let at = if m.to_scratch { slot } else { self.base }.wrapping_add(m.at);
            let g = if m.level == Level::Local {
                local
            } else {
                cross
            };
            let mut req = null_request();
            // SAFETY: `at` holds the message's bytes (ranges and counts checked in
            // `run`) and no other request nor sum touches them until this one
            // completes: lanes own disjoint pieces and slots, and a lane's sums run
            // only once its round has completed.
            check(CALL, unsafe {
                post_one(m, at, send, self.dtype, g, &mut req)
            })?;
            self.flight.reqs.push(req);
            self.flight.lane.push(i);
        }
        self.pending[i] = r.recvs.len() + r.sends.len();
        Ok(())
    }

    /// Waits for some messages; returns the lanes whose round they completed.
    fn wait_some(&mut self) -> Result<Vec<usize>> {
        let n = count(CALL, self.flight.reqs.len())?;
        let mut indices: Vec<c_int> = vec![0; self.flight.reqs.len()];
        let mut out: c_int = 0;
        // SAFETY: the requests are valid (posted, those completed earlier removed
        // below); `indices` holds `n` entries.
        check(CALL, unsafe {
            ffi::MPI_Waitsome(
                n,
                self.flight.reqs.as_mut_ptr(),
                &mut out,
                indices.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        })?;
        let mut ready = Vec::new();
        for &k in &indices[..usize::try_from(out).unwrap_or(0)] {
            let Some(&i) = usize::try_from(k)
                .ok()
                .and_then(|k| self.flight.lane.get(k))
            else {
                continue;
            };
            self.pending[i] -= 1;
            if self.pending[i] == 0 {
                ready.push(i);
            }
        }
        // MPI set the completed requests to MPI_REQUEST_NULL: drop them.
        let null = null_request();
        let kept: Vec<bool> = self.flight.reqs.iter().map(|&r| r != null).collect();
        let mut keep = kept.iter();
        self.flight.lane.retain(|_| *keep.next().unwrap_or(&false));
        self.flight.reqs.retain(|&r| r != null);
        Ok(ready)
    }

    /// Lane `i`'s round has arrived: adds what it received, posts its next round.
    fn finish_round(&mut self, i: usize) -> Result<()> {
        let round = &self.lanes[i].rounds[self.done[i]];
        let slot = self.slot_of(i);
        for &(at, from, len) in &round.adds {
            // SAFETY: the round's messages have all completed, so nothing in flight
            // touches this lane's slot or its piece of the buffer; other lanes work
            // on other pieces and slots; the ranges lie inside (checked in `run`).
            let (acc, got) = unsafe {
                (
                    std::slice::from_raw_parts_mut(self.base.add(at), len),
                    std::slice::from_raw_parts(slot.add(from), len),
                )
            };
            add_into(acc, got, self.dtype);
        }
        self.done[i] += 1;
        if self.done[i] < self.lanes[i].rounds.len() {
            self.post(i)?;
        }
        Ok(())
    }
}

/// Posts `m` (`send`: as a send) at `at` on `g`.
///
/// # Safety
/// `at` must be valid for `m.len` bytes until the request completes, and nothing else
/// may read (a receive) or write them meanwhile; `m.len / dtype.size_of()` must fit a
/// C int.
unsafe fn post_one(
    m: &Msg,
    at: *mut u8,
    send: bool,
    dtype: DType,
    g: Group,
    req: &mut ffi::MPI_Request,
) -> c_int {
    let elems = (m.len / dtype.size_of()) as c_int;
    let peer = m.peer as c_int;
    // SAFETY: as the caller promises.
    unsafe {
        if send {
            ffi::MPI_Isend(
                at.cast_const().cast(),
                elems,
                datatype(dtype),
                peer,
                m.tag,
                g.comm,
                req,
            )
        } else {
            ffi::MPI_Irecv(at.cast(), elems, datatype(dtype), peer, m.tag, g.comm, req)
        }
    }
}
