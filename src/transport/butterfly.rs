//! The arithmetic of recursive halving and doubling over `n` ranks, shared by the
//! MPI transport's flat sum (`transport/mpi/halving.rs`), the pipelined plan's
//! cross-host sum (`transport/schedule.rs`) and the count of its host-local steps
//! (`Hosts::near_steps`): `p`, the largest power of two ≤ `n`, take part; of ranks
//! `0..2·rem` (`rem = n − p`) each even rank folds its buffer into the odd rank
//! after it first and gets the result back last; participant `v` is rank `2v + 1`
//! below `rem`, `v + rem` after; step `k` pairs participant `v` with `v ^ 2^k`.

/// The participants of a butterfly over `n` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fold {
    /// How many take part (a power of two), and how many ranks were folded into others.
    pub(crate) p: usize,
    pub(crate) rem: usize,
}

impl Fold {
    /// The butterfly over `n` ≥ 1 ranks.
    pub(crate) fn new(n: usize) -> Fold {
        let p = 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
        Fold {
            p,
            rem: n.max(1) - p,
        }
    }

    /// The butterfly's steps.
    pub(crate) fn steps(&self) -> u32 {
        self.p.trailing_zeros()
    }

    /// Whether rank `me` is one of a folded pair (it sends or receives the whole
    /// buffer first and last).
    pub(crate) fn folded(&self, me: usize) -> bool {
        me < 2 * self.rem
    }

    /// Rank `me`'s place among the participants, or None for an even rank of a
    /// folded pair (its odd neighbour takes part for both).
    pub(crate) fn participant(&self, me: usize) -> Option<usize> {
        if self.folded(me) {
            (me % 2 == 1).then_some(me / 2)
        } else {
            Some(me - self.rem)
        }
    }

    /// The rank of participant `v`.
    pub(crate) fn rank(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// The rank participant `v` exchanges with at step `k`.
    pub(crate) fn peer(&self, v: usize, k: u32) -> usize {
        self.rank(v ^ (1 << k))
    }

    /// Where block `c` (of the `p` blocks of `len` elements) starts; block `p` starts
    /// at `len`.
    pub(crate) fn block_start(&self, len: usize, c: usize) -> usize {
        if c == self.p {
            len
        } else {
            crate::transport::ring::chunk(len, self.p, c).0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Fold;

    #[test]
    fn participants_and_peers() {
        // 6 ranks: 4 take part, ranks 0 and 2 fold into 1 and 3.
        let f = Fold::new(6);
        assert_eq!((f.p, f.rem, f.steps()), (4, 2, 2));
        let places: Vec<Option<usize>> = (0..6).map(|r| f.participant(r)).collect();
        assert_eq!(places, [None, Some(0), None, Some(1), Some(2), Some(3)]);
        assert_eq!((0..4).map(|v| f.rank(v)).collect::<Vec<_>>(), [1, 3, 4, 5]);
        assert_eq!(f.peer(0, 1), 4);
        assert_eq!(Fold::new(8).peer(5, 0), 4);
        assert_eq!((f.block_start(10, 1), f.block_start(10, 4)), (3, 10));
        assert_eq!(Fold::new(1), Fold { p: 1, rem: 0 });
    }
}
