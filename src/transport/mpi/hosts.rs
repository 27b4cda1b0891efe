//! A job that spans hosts: the ranks of each host (`Hosts`, which orders the ring and
//! lays out the hierarchical allgather), the hierarchical allreduce (reduce-scatter in
//! the host, allreduce across hosts, allgather in the host; large sums across many
//! hosts in pieces through `pipeline.rs`) and its communicator levels.

use std::ffi::c_int;

use mpi::raw::AsRaw;

use super::group::{allgatherv_on, allreduce_in_place, reduce_scatter_on, Group};
use super::rings::{ring_allreduce, ring_allreduce_with, RING_MIN_BYTES_HOSTS, RING_SEGMENT_BYTES};
use super::types::{per_rank, sized};
use super::MpiTransport;
use crate::error::Result;
use crate::tensor::DType;
use crate::transport::choice::{hierarchical_pieces, FlatSum};
use crate::transport::schedule::{self, Shape};
use crate::vocab::ReduceOp;

impl MpiTransport {
    /// Allreduce in three steps: reduce-scatter among this host's ranks (shared
    /// memory), allreduce of this rank's shard among the ranks with its local rank
    /// (one per host: only shards cross the network), allgather of the shards within
    /// the host. Each element is reduced once, by one cross-host allreduce, and
    /// copied everywhere else, so every rank ends with the same bits. Large sums take
    /// kolo's rings for all three steps; other ops and small sums MPI's collectives.
    pub(super) fn hierarchical_allreduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let width = dtype.size_of();
        let n = buf.len() / width;
        let (l, me) = (self.topology.local_size, self.topology.local_rank);
        let mpi_op = self.reduce_op(op, dtype);
        let (local, cross) = self.levels();
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        // Large sums across many hosts: in pieces, pipelined (`transport/schedule.rs`).
        let pieces = hierarchical_pieces(self.piece_bytes, buf.len(), cross.size);
        if sum && cross.size > 1 && pieces > 1 {
            return self.pipelined_allreduce(buf, dtype, pieces);
        }
        let mut scratch = std::mem::take(&mut self.shard_scratch);
        // Large sums: a ring inside the host whose reduce-scatter leaves each local
        // rank one chunk summed over the host, in place; that chunk is summed across
        // hosts by kolo's ring (the same chunk on every host for the same local rank;
        // on TCP the ring beats MPI_Allreduce called from the engine thread), and the
        // local ring's allgather spreads it. MPI_Reduce_scatter, which this replaced,
        // allocates a scratch of the message on every call: at 2 hosts × 2 ranks,
        // 1 Gbit/s, it took 120-480 ms of a 890 ms allreduce of 64 MiB. The choice
        // depends on nothing rank-specific, so every rank of the job makes it alike.
        if sum && cross.size > 1 && n / l * width >= RING_MIN_BYTES_HOSTS {
            let local_order: Vec<usize> = (0..l).collect();
            let cross_order: Vec<usize> = (0..cross.size).collect();
            let result = ring_allreduce_with(
                local,
                &local_order,
                me,
                &mut self.ring_scratch,
                buf,
                dtype,
                Some(RING_SEGMENT_BYTES),
                &mut |mine| match cross_sum(self.algorithm, cross.size, mine.len()) {
                    FlatSum::HalvingDoubling => {
                        super::halving::halving_doubling(cross, 0, &mut scratch, mine, dtype)
                    }
                    _ => ring_allreduce(
                        cross,
                        &cross_order,
                        cross.rank,
                        &mut scratch,
                        mine,
                        dtype,
                        None,
                    ),
                },
            );
            self.shard_scratch = scratch;
            return result;
        }
        let shards: Vec<usize> = (0..l).map(|i| n / l + usize::from(i < n % l)).collect();
        scratch.clear();
        scratch.resize(shards[me] * width, 0);
        let halve = sum
            && cross_sum(self.algorithm, cross.size, shards[me] * width)
                == FlatSum::HalvingDoubling;
        let mut halving_scratch = Vec::new();
        let result = reduce_scatter_on(local, buf, &mut scratch, &shards, dtype, mpi_op)
            .and_then(|()| {
                if halve {
                    let (c, s) = (cross, &mut scratch);
                    super::halving::halving_doubling(c, 0, &mut halving_scratch, s, dtype)
                } else {
                    allreduce_in_place(cross, &mut scratch, dtype, mpi_op)
                }
            })
            .and_then(|()| allgatherv_on(local, &scratch, buf, &shards, dtype));
        self.shard_scratch = scratch;
        result
    }

    /// The hierarchical allreduce of a sum in `pieces` pieces, pipelined.
    fn pipelined_allreduce(&mut self, buf: &mut [u8], dtype: DType, pieces: usize) -> Result<()> {
        let (local, cross) = self.levels();
        let (width, l) = (dtype.size_of(), local.size);
        let shape = Shape {
            local: (l, local.rank),
            cross: (cross.size, cross.rank),
            cross_way: cross_sum(self.algorithm, cross.size, buf.len() / pieces / l),
        };
        let lanes = schedule::plan(shape, buf.len() / width, width, pieces);
        let mut scratch = std::mem::take(&mut self.shard_scratch);
        let result = super::pipeline::run((local, cross), &lanes, buf, &mut scratch, dtype);
        self.shard_scratch = scratch;
        result
    }

    /// The hierarchical allreduce's levels: this host's ranks, and this local rank's
    /// ranks across hosts.
    pub(super) fn levels(&self) -> (Group, Group) {
        let t = &self.topology;
        let local = Group {
            comm: self.local.as_raw(),
            size: t.local_size,
            rank: t.local_rank,
        };
        let cross = Group {
            comm: self.cross.as_raw(),
            size: t.cross_size,
            rank: t.cross_rank,
        };
        (local, cross)
    }
}

/// The ranks of each host: `members[h]` lists host `h`'s ranks in local-rank order
/// (ascending, as `split_shared` keys by rank), hosts in order of their lowest rank.
/// They order the ring, and lay out the hierarchical allgather (which runs only when
/// every host has the same number of ranks).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Hosts {
    pub(super) members: Vec<Vec<usize>>,
}

impl Hosts {
    /// The hosts from every rank's host name (`hosts[r]`, any value shared by the
    /// ranks of one host).
    pub(super) fn of(hosts: &[c_int]) -> Hosts {
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut ids: Vec<c_int> = Vec::new();
        for (r, &h) in hosts.iter().enumerate() {
            match ids.iter().position(|&x| x == h) {
                Some(i) => members[i].push(r),
                None => {
                    ids.push(h);
                    members.push(vec![r]);
                }
            }
        }
        Hosts { members }
    }

    /// The ring's order (ranks grouped by host, so that a round-robin placement
    /// crosses each host boundary once) and `rank`'s position in it.
    pub(super) fn ring(&self, rank: usize) -> (Vec<usize>, usize) {
        let ring = self.members.concat();
        let pos = ring.iter().position(|&r| r == rank).unwrap_or(0);
        (ring, pos)
    }

    /// The host and local rank of `rank`.
    pub(super) fn place(&self, rank: usize) -> (usize, usize) {
        self.members
            .iter()
            .enumerate()
            .find_map(|(h, m)| m.iter().position(|&r| r == rank).map(|i| (h, i)))
            .unwrap_or((0, 0))
    }

    /// How many leading steps of the halving-doubling butterfly over ranks `0..n`
    /// (numbered as here, `transport::butterfly::Fold`) pair ranks of one host on
    /// every rank. The same on every rank.
    pub(super) fn near_steps(&self, n: usize) -> u32 {
        if n < 2 {
            return 0;
        }
        let mut host = vec![usize::MAX; n];
        for (h, m) in self.members.iter().enumerate() {
            for &r in m.iter().filter(|&&r| r < n) {
                host[r] = h;
            }
        }
        let fold = crate::transport::butterfly::Fold::new(n);
        (0..fold.steps())
            .take_while(|&k| (0..fold.p).all(|v| host[fold.rank(v)] == host[fold.peer(v, k)]))
            .count() as u32
    }

    /// The hosts in the cross-host communicator of local rank `i`, in its rank order
    /// (it is split with the job rank as key).
    fn cross_order(&self, i: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.members.len()).collect();
        order.sort_by_key(|&h| self.members[h][i]);
        order
    }

    /// Elements of each share of a host block of `total` elements cut in `l`:
    /// (offset, length) of share `k`.
    pub(super) fn share(total: usize, l: usize, k: usize) -> (usize, usize) {
        let (q, r) = (total / l, total % l);
        (k * q + k.min(r), q + usize::from(k < r))
    }

    /// Allgatherv in three steps: gather this host's block within the host; send
    /// share `local_rank` of it to the same local rank on every other host (so each
    /// byte crosses to each host once); gather those shares within the host; then
    /// lay the blocks out in job-rank order, as the flat allgather would.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn allgatherv(
        &self,
        local: Group,
        cross: Group,
        rank: usize,
        (send, recv): (&[u8], &mut [u8]),
        counts_: &[usize],
        dtype: DType,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        const CALL: &str = "MPI_Allgatherv (hierarchical)";
        per_rank(CALL, counts_, counts_.len())?;
        sized(CALL, "receive", recv.len(), counts_.iter().sum(), dtype)?;
        let w = dtype.size_of();
        let (me_host, me_local) = self.place(rank);
        let l = self.members[me_host].len();
        let block = |h: usize| -> usize { self.members[h].iter().map(|&r| counts_[r]).sum() };
        let blocks: Vec<usize> = (0..self.members.len()).map(block).collect();
        // Scratch: this host's block, this rank's shares of every host, all shares.
        let total: usize = blocks.iter().sum();
        let mine_len = blocks[me_host];
        let order = self.cross_order(me_local);
        let shares_len: usize = order
            .iter()
            .map(|&h| Self::share(blocks[h], l, me_local).1)
            .sum();
        scratch.clear();
        scratch.resize((mine_len + shares_len + total) * w, 0);
        let (host_block, rest) = scratch.split_at_mut(mine_len * w);
        let (my_shares, all) = rest.split_at_mut(shares_len * w);
        // 1. This host's block, in local-rank order.
        let local_counts: Vec<usize> = self.members[me_host].iter().map(|&r| counts_[r]).collect();
        allgatherv_on(local, send, host_block, &local_counts, dtype)?;
        // 2. Share `me_local` of every host's block, in this cross group's order.
        let (off, len) = Self::share(mine_len, l, me_local);
        let cross_counts: Vec<usize> = order
            .iter()
            .map(|&h| Self::share(blocks[h], l, me_local).1)
            .collect();
        allgatherv_on(
            cross,
            &host_block[off * w..(off + len) * w],
            my_shares,
            &cross_counts,
            dtype,
        )?;
        // 3. Every local rank's shares: local rank k's part lists share k of each host
        // in its cross group's order.
        let gathered: Vec<usize> = (0..l)
            .map(|k| {
                (0..self.members.len())
                    .map(|h| Self::share(blocks[h], l, k).1)
                    .sum()
            })
            .collect();
        allgatherv_on(local, my_shares, all, &gathered, dtype)?;
        self.lay_out(all, recv, counts_, &blocks, l, w);
        Ok(())
    }

    /// Copies the gathered shares (`all`: local rank k's part, for k in 0..`l`, lists
    /// share k of each host in its cross group's order) to their ranks' places in
    /// `recv` (job-rank order, `counts` elements of `w` bytes each). Each share covers
    /// part of its host's block, which lists the host's ranks in local order.
    fn lay_out(
        &self,
        all: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        blocks: &[usize],
        l: usize,
        w: usize,
    ) {
        // Where each rank's tensor starts in `recv` (job-rank order).
        let mut starts = Vec::with_capacity(counts.len());
        let mut at = 0;
        for &c in counts {
            starts.push(at);
            at += c;
        }
        // Each share covers part of its host's block, which lists the host's ranks in
        // local order: copy the pieces to their ranks' places.
        let mut at = 0;
        for k in 0..l {
            for h in self.cross_order(k) {
                let (off, len) = Self::share(blocks[h], l, k);
                let piece = &all[at * w..(at + len) * w];
                at += len;
                let mut member_start = 0;
                for &r in &self.members[h] {
                    let (a, b) = (member_start, member_start + counts[r]);
                    member_start = b;
                    let (from, to) = (a.max(off), b.min(off + len));
                    if from < to {
                        let dst = starts[r] + (from - a);
                        recv[dst * w..(dst + to - from) * w]
                            .copy_from_slice(&piece[(from - off) * w..(to - off) * w]);
                    }
                }
            }
        }
    }
}

/// How the hierarchical allreduce sums a shard of `bytes` across `hosts` hosts: the
/// flat rule with every hop crossing hosts.
fn cross_sum(algorithm: crate::vocab::AllreduceAlgorithm, hosts: usize, bytes: usize) -> FlatSum {
    crate::transport::choice::flat_sum(algorithm, hosts, bytes, true, RING_MIN_BYTES_HOSTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_list_their_ranks_and_shares_cover_each_block() {
        // Round-robin placement: 0 and 2 on host 0, 1 and 3 on host 1.
        let h = Hosts::of(&[0, 1, 0, 1]);
        assert_eq!(h.members, [vec![0, 2], vec![1, 3]]);
        assert_eq!(h.place(3), (1, 1));
        assert_eq!(h.place(2), (0, 1));
        assert_eq!(h.cross_order(1), [0, 1]);
        // Hosts named so that local rank 1's group orders them the other way.
        let h = Hosts::of(&[5, 5, 7, 7, 7, 5]);
        assert_eq!(h.members, [vec![0, 1, 5], vec![2, 3, 4]]);
        assert_eq!(h.cross_order(0), [0, 1]);
        assert_eq!(h.cross_order(2), [1, 0]);
        for (total, l) in [(0, 2), (1, 3), (10, 3), (7, 7)] {
            let mut next = 0;
            for k in 0..l {
                let (off, len) = Hosts::share(total, l, k);
                assert_eq!(
                    off,
                    next,
                    "{total} in {l}: share {k} starts where {} ends",
                    k.max(1) - 1
                );
                next += len;
            }
            assert_eq!(next, total);
        }
    }

    #[test]
    fn near_steps_count_the_butterfly_steps_inside_hosts() {
        let blocks = |hosts: usize, l: usize| {
            let names: Vec<c_int> = (0..hosts * l).map(|r| (r / l) as c_int).collect();
            Hosts::of(&names)
        };
        // 8 hosts of 8, filled in order: the first three steps stay inside.
        assert_eq!(blocks(8, 8).near_steps(64), 3);
        assert_eq!(blocks(2, 2).near_steps(4), 1);
        // One host: every step.
        assert_eq!(blocks(1, 4).near_steps(4), 2);
        // Round-robin placement: the first step already crosses.
        assert_eq!(Hosts::of(&[0, 1, 0, 1]).near_steps(4), 0);
        // Hosts of 3 (not a power of two): 2 steps of distance 1 and 2 cannot both
        // stay inside; distance 1 does not either for every pair.
        assert_eq!(blocks(4, 3).near_steps(12), 0);
        // 6 ranks on hosts of 2: ranks 0..4 fold in pairs (1 and 3 take part), the
        // butterfly's 1, 3, 4, 5 pair 1–3 (hosts 0, 1) first: nothing inside.
        assert_eq!(blocks(3, 2).near_steps(6), 0);
        // 12 ranks on hosts of 4: ranks 0..8 fold in pairs (1, 3, 5, 7 take part,
        // then 8..12), distance 1 pairs 1–3, 5–7, 8–9, 10–11 inside their hosts,
        // distance 2 pairs 1–5 across.
        assert_eq!(blocks(3, 4).near_steps(12), 1);
        // 10 ranks on hosts of 5: participants 1, 3, 4..9; 4–5 cross at distance 1.
        assert_eq!(blocks(2, 5).near_steps(10), 0);
    }

    #[test]
    fn the_ring_visits_hosts_one_after_another() {
        // Ranks placed round-robin over two hosts (named by their lowest rank).
        assert_eq!(Hosts::of(&[0, 1, 0, 1]).ring(1), (vec![0, 2, 1, 3], 2));
        assert_eq!(Hosts::of(&[0, 1, 0, 1]).ring(2), (vec![0, 2, 1, 3], 1));
        // Filled host by host: the ring is the rank order.
        assert_eq!(Hosts::of(&[0, 0, 2, 2]).ring(3), (vec![0, 1, 2, 3], 3));
        // Uneven hosts, three of them.
        assert_eq!(
            Hosts::of(&[0, 1, 2, 0, 1, 0]).ring(4),
            (vec![0, 3, 5, 1, 4, 2], 4)
        );
        assert_eq!(Hosts::of(&[7]).ring(0), (vec![0], 0));
    }
}
