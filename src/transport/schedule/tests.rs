//! Every rank's plan run in memory: messages matched by level, group, sender,
//! receiver and tag in the order they were sent, as MPI matches them; each lane's
//! scratch slot shared as the MPI transport shares it.

use std::collections::{HashMap, VecDeque};

use super::*;
use crate::tensor::DType;
use crate::transport::ring::add_into;

type Key = (Level, usize, usize, usize, i32);

/// A job of `hosts` × `l` ranks (rank `h·l + i` is local rank `i` of host `h`), each
/// with its plan over its own buffer, in memory.
struct Job {
    l: usize,
    dtype: DType,
    plans: Vec<Vec<Lane>>,
    data: Vec<Vec<u8>>,
    /// Each rank's slots, as large as its own lanes need (as the transport sizes them).
    scratch: Vec<Vec<Vec<u8>>>,
    done: Vec<Vec<usize>>,
    posted: Vec<Vec<bool>>,
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// The lane whose posted receives may be writing each rank's scratch slot.
    owners: Vec<[Option<usize>; WINDOW]>,
}

impl Job {
    fn new(
        hosts: usize,
        l: usize,
        way: FlatSum,
        pieces: usize,
        dtype: DType,
        data: Vec<Vec<u8>>,
    ) -> Job {
        let n = hosts * l;
        let (es, len) = (dtype.size_of(), data[0].len() / dtype.size_of());
        let shape = |r: usize| Shape {
            local: (l, r % l),
            cross: (hosts, r / l),
            cross_way: way,
        };
        let plans: Vec<Vec<Lane>> = (0..n).map(|r| plan(shape(r), len, es, pieces)).collect();
        let scratch = plans
            .iter()
            .map(|p| vec![vec![0u8; p.iter().map(|x| x.scratch).max().unwrap_or(0)]; WINDOW])
            .collect();
        let lanes = plans[0].len();
        Job {
            l,
            dtype,
            plans,
            data,
            scratch,
            done: vec![vec![0; lanes]; n],
            posted: vec![vec![false; lanes]; n],
            queues: HashMap::new(),
            owners: vec![[None; WINDOW]; n],
        }
    }

    /// Where rank `r` sits in a level: (group, rank in it).
    fn place(&self, r: usize, lv: Level) -> (usize, usize) {
        match lv {
            Level::Local => (r / self.l, r % self.l),
            Level::Cross => (r % self.l, r / self.l),
        }
    }

    /// Posts rank `r`'s lane `i`'s current round: its sends are queued at once.
    fn post(&mut self, r: usize, i: usize) {
        let round = &self.plans[r][i].rounds[self.done[r][i]];
        for m in &round.sends {
            let (g, me) = self.place(r, m.level);
            let bytes = self.data[r][m.at..m.at + m.len].to_vec();
            self.queues
                .entry((m.level, g, me, m.peer, m.tag))
                .or_default()
                .push_back(bytes);
        }
        // A lane's scratch slot may be written by its receives from the moment they
        // are posted until its sums have read it: no other lane may use it meanwhile.
        if round.recvs.iter().any(|m| m.to_scratch) {
            let owner = &mut self.owners[r][i % WINDOW];
            assert!(
                owner.is_none_or(|o| o == i),
                "rank {r}: lanes {i} and {owner:?} use scratch slot {} at once",
                i % WINDOW
            );
            *owner = Some(i);
        }
        self.posted[r][i] = true;
    }

    /// Completes rank `r`'s lane `i`'s posted round if all its messages have come.
    fn try_finish(&mut self, r: usize, i: usize) -> bool {
        let round = self.plans[r][i].rounds[self.done[r][i]].clone();
        let key = |m: &Msg| {
            let (g, me) = self.place(r, m.level);
            (m.level, g, m.peer, me, m.tag)
        };
        let keys: Vec<Key> = round.recvs.iter().map(key).collect();
        if !keys
            .iter()
            .all(|k| self.queues.get(k).is_some_and(|q| !q.is_empty()))
        {
            return false;
        }
        let s = &mut self.scratch[r][i % WINDOW];
        for (m, k) in round.recvs.iter().zip(&keys) {
            let got = self
                .queues
                .get_mut(k)
                .and_then(VecDeque::pop_front)
                .expect("checked above");
            assert_eq!(
                got.len(),
                m.len,
                "rank {r} lane {i}: a message of {} bytes, expected {}",
                got.len(),
                m.len
            );
            let into = if m.to_scratch {
                &mut s[m.at..m.at + m.len]
            } else {
                &mut self.data[r][m.at..m.at + m.len]
            };
            into.copy_from_slice(&got);
        }
        for &(at, from, len) in &round.adds {
            add_into(
                &mut self.data[r][at..at + len],
                &s[from..from + len],
                self.dtype,
            );
        }
        self.done[r][i] += 1;
        self.posted[r][i] = false;
        if self.owners[r][i % WINDOW] == Some(i) {
            self.owners[r][i % WINDOW] = None;
        }
        true
    }

    /// Runs every rank until nothing moves; panics on a round that can never complete.
    fn run(mut self) -> Vec<Vec<u8>> {
        loop {
            let mut progress = false;
            for r in 0..self.plans.len() {
                for i in 0..self.plans[r].len() {
                    let lane = &self.plans[r][i];
                    if self.done[r][i] == lane.rounds.len()
                        || !may_start(&self.plans[r], &self.done[r], i)
                    {
                        continue;
                    }
                    if !self.posted[r][i] {
                        self.post(r, i);
                        progress = true;
                    }
                    progress |= self.try_finish(r, i);
                }
            }
            if !progress {
                break;
            }
        }
        for (r, plans) in self.plans.iter().enumerate() {
            for (i, lane) in plans.iter().enumerate() {
                assert_eq!(
                    self.done[r][i],
                    lane.rounds.len(),
                    "rank {r}'s lane {i} never finished"
                );
            }
        }
        assert!(
            self.queues.values().all(VecDeque::is_empty),
            "messages left unreceived"
        );
        self.data
    }
}

/// Runs the plans of a job of `hosts` × `l` ranks over `data` (one buffer per rank).
fn run(hosts: usize, l: usize, way: FlatSum, pieces: usize, dtype: DType, data: &mut Vec<Vec<u8>>) {
    let job = Job::new(hosts, l, way, pieces, dtype, std::mem::take(data));
    *data = job.run();
}

fn jobs() -> Vec<(usize, usize)> {
    vec![
        (1, 1),
        (1, 3),
        (2, 1),
        (2, 2),
        (2, 3),
        (3, 2),
        (4, 2),
        (5, 3),
        (8, 2),
        (6, 4),
    ]
}

#[test]
fn every_rank_gets_the_exact_integer_sum() {
    for (hosts, l) in jobs() {
        for way in [FlatSum::Ring, FlatSum::HalvingDoubling] {
            for pieces in [1, 2, 5, 64] {
                for len in [1, 7, 100, 20_000] {
                    let n = hosts * l;
                    let value = |r: usize, j: usize| ((r * 31 + j * 7) % 1000) as i32 - 500;
                    let mut data: Vec<Vec<u8>> = (0..n)
                        .map(|r| (0..len).flat_map(|j| value(r, j).to_ne_bytes()).collect())
                        .collect();
                    run(hosts, l, way, pieces, DType::I32, &mut data);
                    for (r, d) in data.iter().enumerate() {
                        let got: &[i32] = bytemuck::cast_slice(d);
                        for (j, &x) in got.iter().enumerate() {
                            let want: i32 = (0..n).map(|q| value(q, j)).sum();
                            assert_eq!(x, want, "{hosts}×{l} {way:?} {pieces} pieces, {len} elements: rank {r} element {j}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn float_sums_are_the_same_bits_on_every_rank() {
    for (hosts, l) in [(4, 2), (3, 3), (5, 2)] {
        for way in [FlatSum::Ring, FlatSum::HalvingDoubling] {
            let (n, len) = (hosts * l, 50_000);
            let mut data: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    (0..len)
                        .flat_map(|j| {
                            (((r * 7919 + j * 104729) % 9973) as f32 / 97.0).to_ne_bytes()
                        })
                        .collect()
                })
                .collect();
            run(hosts, l, way, 4, DType::F32, &mut data);
            for r in 1..n {
                assert!(
                    data[r] == data[0],
                    "{hosts}×{l} {way:?}: rank {r}'s sum differs from rank 0's"
                );
            }
            let got: &[f32] = bytemuck::cast_slice(&data[0]);
            let want: f32 = (0..n).map(|r| ((r * 7919) % 9973) as f32 / 97.0).sum();
            assert!(
                (got[0] - want).abs() <= 1e-3 * want.abs(),
                "element 0: {} vs {want}",
                got[0]
            );
        }
    }
}

#[test]
fn a_lane_starts_after_the_one_before_reduced_inside_its_host() {
    let shape = Shape {
        local: (4, 1),
        cross: (2, 0),
        cross_way: FlatSum::Ring,
    };
    let pieces = WINDOW + 2;
    let lanes = plan(shape, 1000, 4, pieces);
    assert_eq!(lanes.len(), pieces);
    // 3 reduce-scatter steps inside the host, 2 across (ring of 2), 3 allgather steps.
    assert_eq!(lanes[0].lead, 3);
    assert_eq!(lanes[0].rounds.len(), 8);
    let mut done = vec![0; pieces];
    assert!(may_start(&lanes, &done, 0));
    done[0] = 2;
    assert!(!may_start(&lanes, &done, 1));
    done[0] = 3;
    assert!(may_start(&lanes, &done, 1));
    // Lane WINDOW reuses lane 0's scratch slot: it waits for lane 0 to end.
    done = vec![8; pieces];
    done[0] = 7;
    assert!(!may_start(&lanes, &done, WINDOW));
    done[0] = 8;
    assert!(may_start(&lanes, &done, WINDOW));
    // Tags: three per piece, no two pieces alike.
    let tags: std::collections::BTreeSet<i32> = lanes
        .iter()
        .flat_map(|x| x.rounds.iter().flat_map(|r| r.sends.iter().map(|m| m.tag)))
        .collect();
    assert_eq!(tags.len(), 3 * pieces);
}
