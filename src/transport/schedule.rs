//! The pipelined hierarchical allreduce as data: for each piece of the buffer a lane
//! of rounds (a ring reduce-scatter inside the host, a sum of this rank's chunk
//! across hosts, a ring allgather inside the host), each round a set of messages and,
//! once they have arrived, the sums they bring. Several lanes run at once, so that
//! while one piece crosses hosts the next is reduced inside the host and the one
//! before is spread: the host's links and the network's work at the same time, as
//! NCCL overlaps NVLink and the network with its channels. Without that overlap a
//! 64 MiB sum at 4096 ranks took 1.85× the α–β bound in `kolo-sim` (the three
//! phases one after another), with it 1.13×.
//!
//! The plan is pure (no MPI): the MPI transport posts a lane's round as non-blocking
//! messages and runs the sums when they complete (`transport/mpi/pipeline.rs`), and
//! the tests below run every rank's plan in memory. Every chunk's sum is computed by
//! one rank and copied to the others, as in the other sums, so every rank ends with
//! the same bits.

use crate::transport::butterfly::Fold;
use crate::transport::choice::{FlatSum, MAX_PIECES};
use crate::transport::ring::{chunk, send_chunk};

/// The communicator a message travels on: this host's ranks, or this local rank's
/// ranks across hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Level {
    Local,
    Cross,
}

/// A message: to or from `peer` (a rank of `level`'s communicator) with `tag`,
/// `len` bytes at byte `at` of the buffer (`to_scratch`: of the lane's scratch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Msg {
    pub(crate) level: Level,
    pub(crate) peer: usize,
    pub(crate) tag: i32,
    pub(crate) at: usize,
    pub(crate) len: usize,
    pub(crate) to_scratch: bool,
}

/// One round of a lane: its messages, posted together, then once all have arrived
/// `adds`: `buf[at..at + len] += scratch[from..from + len]` for each `(at, from, len)`.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Round {
    pub(crate) sends: Vec<Msg>,
    pub(crate) recvs: Vec<Msg>,
    pub(crate) adds: Vec<(usize, usize, usize)>,
}

/// One piece's rounds, the scratch bytes they receive into, and after how many of
/// them the next lane may start (the end of the reduce-scatter inside the host).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Lane {
    pub(crate) rounds: Vec<Round>,
    pub(crate) lead: usize,
    pub(crate) scratch: usize,
}

/// This rank's place in the two levels, and how the chunks are summed across hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Ranks on this host, and this rank's local rank.
    pub(crate) local: (usize, usize),
    /// Hosts, and this rank's place among the ranks with its local rank.
    pub(crate) cross: (usize, usize),
    /// The sum across hosts: [`FlatSum::HalvingDoubling`], or a ring.
    pub(crate) cross_way: FlatSum,
}

/// Lanes run at once at most (each holds a scratch slot). A piece's sum across
/// many hosts is mostly start-ups (at 4096 ranks on the DGX A100 preset 18 of 5 µs
/// against ~22 µs of transfer for a 2 MiB piece), which only other lanes' transfers
/// fill: `kolo-sim`, a 64 MiB sum in 2 MiB pieces, 1.13× the α–β bound with 8 lanes
/// at once, 1.75× with 4, 2.29× with 3 (1.85× without pieces).
pub(crate) const WINDOW: usize = 8;

/// Tags of the plan's messages start here (the ring uses 7, the agreement 11, the
/// halving 13); each piece takes three (at most [`MAX_PIECES`]: far below MPI's
/// guaranteed 32767).
const TAG_BASE: i32 = 100;

/// The plan of an in-place sum of `len` elements of `es` bytes in `pieces` pieces
/// (1 to [`MAX_PIECES`]), for the rank at `shape`.
pub(crate) fn plan(shape: Shape, len: usize, es: usize, pieces: usize) -> Vec<Lane> {
    let pieces = pieces.clamp(1, MAX_PIECES);
    (0..pieces)
        .map(|p| {
            let (a, b) = chunk(len, pieces, p);
            let tag = TAG_BASE + 3 * p as i32;
            let mut lane = LaneBuilder {
                lane: Lane::default(),
                es,
            };
            let (l, me) = shape.local;
            let (ca, cb) = lane.ring_reduce_scatter(Level::Local, tag, l, me, a, b - a);
            lane.lane.lead = lane.lane.rounds.len();
            let (h, cr) = shape.cross;
            match shape.cross_way {
                FlatSum::HalvingDoubling => lane.halving_doubling(tag + 1, h, cr, ca, cb - ca),
                _ => {
                    // The ring's summed chunk stays where the allgather finds it.
                    let _ = lane.ring_reduce_scatter(Level::Cross, tag + 1, h, cr, ca, cb - ca);
                    lane.ring_allgather(Level::Cross, tag + 1, h, cr, ca, cb - ca);
                }
            }
            lane.ring_allgather(Level::Local, tag + 2, l, me, a, b - a);
            lane.lane
        })
        .collect()
}

/// Whether lane `i` may start, given how many rounds each lane has completed
/// (`done[j]`, for the lanes before `i`): the lane before it has finished its
/// reduce-scatter inside the host, and the lane that last used its scratch slot
/// (`i − WINDOW`) has finished.
pub(crate) fn may_start(lanes: &[Lane], done: &[usize], i: usize) -> bool {
    admits(
        i,
        |j| done[j] >= lanes[j].lead,
        |j| done[j] >= lanes[j].rounds.len(),
    )
}

/// The start rule of [`may_start`] over any account of the lanes (the simulator's
/// model of the pipeline uses it too): lane `i` starts once lane `i − 1` has
/// `reduced` (left its reduce-scatter inside the host) and lane `i − WINDOW` has
/// `ended`.
pub(crate) fn admits(
    i: usize,
    reduced: impl Fn(usize) -> bool,
    ended: impl Fn(usize) -> bool,
) -> bool {
    (i == 0 || reduced(i - 1)) && (i < WINDOW || ended(i - WINDOW))
}

/// Ring position `pos` of `n` over elements `[off, off + len)`: its neighbours and
/// where each chunk lies.
struct RingSpans {
    n: usize,
    pos: usize,
    off: usize,
    len: usize,
}

impl RingSpans {
    /// Element range of chunk `c`.
    fn at(&self, c: usize) -> (usize, usize) {
        let (a, b) = chunk(self.len, self.n, c);
        (self.off + a, self.off + b)
    }

    fn right(&self) -> usize {
        (self.pos + 1) % self.n
    }

    fn left(&self) -> usize {
        (self.pos + self.n - 1) % self.n
    }
}

/// Builds one lane's rounds.
struct LaneBuilder {
    lane: Lane,
    es: usize,
}

impl LaneBuilder {
    /// Appends a round that sends `send` (peer, element range) and receives `recv`
    /// (peer, element range), into scratch to be added (`add`) or straight into the
    /// buffer.
    fn round(
        &mut self,
        level: Level,
        tag: i32,
        send: (usize, (usize, usize)),
        recv: (usize, (usize, usize)),
        add: bool,
    ) {
        let es = self.es;
        let msg = |(peer, (a, b)): (usize, (usize, usize)), to_scratch: bool| Msg {
            level,
            peer,
            tag,
            at: if to_scratch { 0 } else { a * es },
            len: (b - a) * es,
            to_scratch,
        };
        let r = msg(recv, add);
        let mut round = Round {
            sends: vec![msg(send, false)],
            recvs: vec![r],
            adds: Vec::new(),
        };
        // An empty chunk (fewer elements than ranks) is still sent, so that every
        // round matches its peer's, but has nothing to add.
        if add && r.len > 0 {
            round.adds.push((recv.1 .0 * es, 0, r.len));
            self.lane.scratch = self.lane.scratch.max(r.len);
        }
        self.lane.rounds.push(round);
    }

    /// A round of one message only: a send (`recv` false), or a receive into the
    /// buffer or into scratch and added (`add`).
    fn one_way(
        &mut self,
        level: Level,
        tag: i32,
        peer: usize,
        (a, b): (usize, usize),
        recv: bool,
        add: bool,
    ) {
        let es = self.es;
        let msg = Msg {
            level,
            peer,
            tag,
            at: if add { 0 } else { a * es },
            len: (b - a) * es,
            to_scratch: add,
        };
        let mut round = Round::default();
        if recv {
            round.recvs.push(msg);
            if add && msg.len > 0 {
                round.adds.push((a * es, 0, msg.len));
                self.lane.scratch = self.lane.scratch.max(msg.len);
            }
        } else {
            round.sends.push(msg);
        }
        self.lane.rounds.push(round);
    }

    /// The reduce-scatter half of a ring over the `n` ranks of `level` (ring order =
    /// rank order) on elements `[off, off + len)`; returns the range this rank then
    /// holds summed (chunk `(pos + 1) mod n`, as `transport/ring.rs` describes).
    fn ring_reduce_scatter(
        &mut self,
        level: Level,
        tag: i32,
        n: usize,
        pos: usize,
        off: usize,
        len: usize,
    ) -> (usize, usize) {
        let ring = RingSpans { n, pos, off, len };
        for s in 0..n.saturating_sub(1) {
            let out = ring.at(send_chunk(pos, s, n));
            let inc = ring.at(send_chunk(pos, s + 1, n));
            self.round(level, tag, (ring.right(), out), (ring.left(), inc), true);
        }
        ring.at(send_chunk(pos, n.saturating_sub(1), n))
    }

    /// The allgather half of that ring: each summed chunk travels once around.
    fn ring_allgather(
        &mut self,
        level: Level,
        tag: i32,
        n: usize,
        pos: usize,
        off: usize,
        len: usize,
    ) {
        let ring = RingSpans { n, pos, off, len };
        for s in 0..n.saturating_sub(1) {
            let out = ring.at(send_chunk(pos, s + n - 1, n));
            let inc = ring.at(send_chunk(pos, s, n));
            self.round(level, tag, (ring.right(), out), (ring.left(), inc), false);
        }
    }

    /// Recursive halving and doubling across hosts (`transport/mpi/halving.rs`'s
    /// algorithm, every step across hosts) on elements `[off, off + len)`. It halves
    /// at every step: the start-ups that the flat sum saves by doubling small pieces
    /// instead (`transport::choice::halvings`) overlap the other lanes' transfers
    /// here, while the bytes such doubling adds would not (`kolo-sim`, 4096 ranks, a
    /// 64 MiB sum in 2 MiB pieces: 1.64× the α–β bound with the flat rule's halving,
    /// 1.13× halving all the way).
    fn halving_doubling(&mut self, tag: i32, n: usize, me: usize, off: usize, len: usize) {
        if n <= 1 {
            return;
        }
        let lv = Level::Cross;
        let whole = (off, off + len);
        let fold = Fold::new(n);
        let folded = fold.folded(me);
        if folded {
            if me.is_multiple_of(2) {
                self.one_way(lv, tag, me + 1, whole, false, false);
            } else {
                self.one_way(lv, tag, me - 1, whole, true, true);
            }
        }
        if let Some(v) = fold.participant(me) {
            let peer = |k: u32| fold.peer(v, k);
            let span = |(a, b): (usize, usize)| {
                (
                    off + fold.block_start(len, a),
                    off + fold.block_start(len, b),
                )
            };
            let mut held = (0usize, fold.p);
            let mut gave = Vec::new();
            for k in 0..fold.steps() {
                let (lo, hi) = held;
                let mid = (lo + hi) / 2;
                let (keep, give) = if v & (1 << k) == 0 {
                    ((lo, mid), (mid, hi))
                } else {
                    ((mid, hi), (lo, mid))
                };
                self.round(lv, tag, (peer(k), span(give)), (peer(k), span(keep)), true);
                gave.push((keep, give));
                held = keep;
            }
            for (k, (keep, give)) in gave.into_iter().enumerate().rev() {
                self.round(
                    lv,
                    tag,
                    (peer(k as u32), span(keep)),
                    (peer(k as u32), span(give)),
                    false,
                );
            }
        }
        if folded {
            if me % 2 == 1 {
                self.one_way(lv, tag, me - 1, whole, false, false);
            } else {
                self.one_way(lv, tag, me + 1, whole, true, false);
            }
        }
    }
}

#[cfg(test)]
mod tests;
