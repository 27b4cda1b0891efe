//! The α–β network model: what a message between two ranks costs, what each allreduce
//! algorithm costs on a topology, and the lower bound no algorithm can beat.
//!
//! Ranks are placed on hosts in order (ranks `h·L … h·L+L−1` on host `h`, as `mpirun`
//! places them by slot). A message of `s` bytes between two ranks costs `α + s/β` of
//! the link between them: the host's (intra) or the network's (inter). Ranks of one
//! host that send across hosts at the same time share the host's network interfaces
//! (`nics_per_host` of them), and an oversubscribed fabric divides what crosses it.
//! Reduction arithmetic and memory traffic inside a rank are not charged here (the
//! fusion copies are, by the simulator, at `copy_bandwidth`).

/// One kind of link: a message of `s` bytes takes `latency + s / bandwidth` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// α: seconds from the send to the first byte's arrival.
    pub latency: f64,
    /// β: bytes per second one flow gets.
    pub bandwidth: f64,
}

impl Link {
    /// Seconds for one message of `bytes` on this link.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }
}

/// A job's network: hosts of equal size, one link kind inside a host and one between
/// hosts.
#[derive(Debug, Clone, PartialEq)]
pub struct Network {
    /// Ranks on each host (the last host may hold fewer when the job does not fill it).
    pub ranks_per_host: usize,
    /// Between two ranks of one host.
    pub intra: Link,
    /// Between two ranks of different hosts, for one flow through one interface.
    pub inter: Link,
    /// Network interfaces per host: up to this many of a host's ranks send across
    /// hosts at full `inter.bandwidth` at once; more share them.
    pub nics_per_host: usize,
    /// ≥ 1: the fabric's oversubscription (inter-host bandwidth divided by it).
    pub oversubscription: f64,
    /// Bytes per second a rank copies into or out of the fusion buffer.
    pub copy_bandwidth: f64,
    /// Simulated seconds per second of this machine's CPU time spent in kolo's
    /// negotiation code (1: the simulated ranks' CPUs are as fast as this one).
    pub cpu_scale: f64,
}

/// The allreduce algorithms the model knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// One ring over every rank in host order: 2(N−1) steps of S/N bytes, each step
    /// as slow as the ring's slowest hop (kolo's ring across hosts).
    Ring,
    /// kolo's hierarchical allreduce: a ring reduce-scatter inside each host, a ring
    /// allreduce of each local rank's S/L chunk across hosts (the L chunks at once),
    /// a ring allgather inside each host.
    Hierarchical,
    /// kolo's hierarchical allreduce in pieces, pipelined (`transport/schedule.rs`):
    /// up to `schedule::WINDOW` pieces at once, the host's links and the network
    /// shared by the pieces on them; the best piece count of 2, 4, … 64.
    HierarchicalPipelined,
    /// Recursive doubling: ⌈log₂N⌉ exchanges of the whole buffer (a rank count that
    /// is not a power of two folds the extra ranks in and out: two more messages).
    RecursiveDoubling,
    /// Recursive halving then doubling (Rabenseifner): a reduce-scatter whose message
    /// halves each step, then the mirror allgather; near neighbours (same host)
    /// first, so the large messages take the fast links.
    HalvingDoubling,
    /// Halving for the first `m` steps, recursive doubling on the remaining 1/2^m of
    /// the buffer for the other steps, then doubling back: between the two above,
    /// `m` chosen per size (the steps' count when m reaches ⌈log₂N⌉ is
    /// [`Algorithm::HalvingDoubling`]'s).
    Hybrid,
    /// What kolo chooses over MPI (`AllreduceAlgorithm::Auto`): hierarchical from
    /// 2 MiB where hosts hold several ranks, its cross-host sum by the flat rule,
    /// pipelined in pieces of 2 MiB across 8 hosts or more; flat:
    /// kolo's ring from 1 MiB across hosts (32 MiB on one host) while a ring step moves
    /// at least 256 KiB or the job has under 8 ranks, halving-doubling across hosts
    /// from 8 ranks and 10 kB (halving down to 64 KiB pieces, doubling those),
    /// otherwise MPI_Allreduce, modelled as Open MPI's classic
    /// fixed rule (recursive doubling up to 10 kB, the ring above).
    Kolo,
    /// kolo before the halving-doubling sum: the same without it (the ring at any
    /// size from 1 MiB across hosts, MPI_Allreduce below).
    KoloBefore,
    /// The cheapest of [`Ring`](Algorithm::Ring),
    /// [`Hierarchical`](Algorithm::Hierarchical),
    /// [`HierarchicalPipelined`](Algorithm::HierarchicalPipelined),
    /// [`RecursiveDoubling`](Algorithm::RecursiveDoubling),
    /// [`HalvingDoubling`](Algorithm::HalvingDoubling) and
    /// [`Hybrid`](Algorithm::Hybrid) for each size: the choice by size and topology.
    Auto,
}

impl Algorithm {
    /// Every algorithm, in the order tables list them.
    pub const ALL: [Algorithm; 9] = [
        Algorithm::Kolo,
        Algorithm::KoloBefore,
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::HierarchicalPipelined,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Hybrid,
        Algorithm::Auto,
    ];

    /// The name the command line and the CSV use.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::HierarchicalPipelined => "hierarchical-pipelined",
            Algorithm::RecursiveDoubling => "recursive-doubling",
            Algorithm::HalvingDoubling => "halving-doubling",
            Algorithm::Hybrid => "hybrid",
            Algorithm::Kolo => "kolo",
            Algorithm::KoloBefore => "kolo-before",
            Algorithm::Auto => "auto",
        }
    }

    /// The algorithm called `name` ([`Algorithm::name`]).
    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// Open MPI's classic rule: recursive doubling up to this many bytes.
const OMPI_RECURSIVE_DOUBLING_MAX: f64 = 10_000.0;
/// kolo's ring from this many bytes across hosts (`RING_MIN_BYTES_HOSTS`) and on one
/// host (`RING_MIN_BYTES_ONE_HOST`).
const KOLO_RING_MIN_HOSTS: f64 = (1 << 20) as f64;
const KOLO_RING_MIN_ONE_HOST: f64 = (32 << 20) as f64;
/// kolo's hierarchical allreduce from this size (`HIERARCHICAL_AUTO_MIN_BYTES`).
const KOLO_HIERARCHICAL_MIN: f64 = (2 << 20) as f64;

impl Network {
    /// The host of rank `r`.
    fn host(&self, r: usize) -> usize {
        r / self.ranks_per_host.max(1)
    }

    /// Hosts of a job of `n` ranks.
    pub fn hosts(&self, n: usize) -> usize {
        n.div_ceil(self.ranks_per_host.max(1))
    }

    /// The link one of `flows` simultaneous flows per host gets across hosts.
    fn inter_for(&self, flows: usize) -> Link {
        let share = (self.nics_per_host.max(1) as f64 / flows.max(1) as f64).min(1.0);
        Link {
            latency: self.inter.latency,
            bandwidth: self.inter.bandwidth * share / self.oversubscription.max(1.0),
        }
    }

    /// The link between ranks `a` and `b` while `flows` ranks per host cross hosts.
    fn link(&self, a: usize, b: usize, flows: usize) -> Link {
        if self.host(a) == self.host(b) {
            self.intra
        } else {
            self.inter_for(flows)
        }
    }

    /// Seconds for the exchange steps of a butterfly over `n` ranks where step `k`
    /// (distance 2^k: every rank exchanges with the rank at that distance, all at
    /// once) costs `step(k, link)` on the link it takes. A rank count that is not a
    /// power of two adds a fold in and a fold out of `fold_bytes` each.
    fn butterfly(&self, n: usize, fold_bytes: f64, step: impl Fn(u32, Link) -> f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let l = self.ranks_per_host.max(1);
        let mut t = 0.0;
        if p < n {
            // Ranks p.. fold into ranks 0..: across hosts unless the job is one host.
            let link = self.link(0, p, l.min(n - p));
            t += 2.0 * link.time(fold_bytes);
        }
        for k in 0..p.trailing_zeros() {
            let d = 1usize << k;
            // Every rank talks to rank ± d: inside the host while d < L (hosts of a
            // power-of-two size), otherwise all L ranks of a host cross at once.
            t += step(k, self.link(0, d, l));
        }
        t
    }

    /// One ring over `n` ranks (host order) moving `chunk` bytes per step, 2(n−1)
    /// steps, each as slow as its slowest hop. `flows` ranks per host cross at once.
    fn ring(&self, n: usize, chunk: f64, flows: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let hop = if self.hosts(n) > 1 {
            self.inter_for(flows)
        } else {
            self.intra
        };
        2.0 * (n - 1) as f64 * hop.time(chunk)
    }

    /// Seconds for an allreduce of `bytes` over `n` ranks with `algorithm`.
    pub fn allreduce(&self, algorithm: Algorithm, n: usize, bytes: f64) -> f64 {
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let l = self.ranks_per_host.max(1).min(n);
        let h = self.hosts(n);
        match algorithm {
            Algorithm::Ring => self.ring(n, bytes / n as f64, 1),
            Algorithm::Hierarchical => {
                if !self.two_levels(n) {
                    return self.ring(n, bytes / n as f64, 1);
                }
                let local = (l - 1) as f64 * self.intra.time(bytes / l as f64);
                let cross = self.ring_across(h, bytes / l as f64, l);
                local + cross + local
            }
            Algorithm::HierarchicalPipelined => {
                if !self.two_levels(n) {
                    return self.ring(n, bytes / n as f64, 1);
                }
                (1..=6)
                    .map(|k| self.pipelined(h, bytes, 1 << k))
                    .fold(f64::INFINITY, f64::min)
            }
            Algorithm::RecursiveDoubling => self.butterfly(n, bytes, |_, link| link.time(bytes)),
            Algorithm::HalvingDoubling => self.hybrid(n, bytes, u32::MAX),
            Algorithm::Hybrid => {
                let steps = usize::BITS - 1 - n.leading_zeros();
                (0..=steps)
                    .map(|m| self.hybrid(n, bytes, m))
                    .fold(f64::INFINITY, f64::min)
            }
            Algorithm::Kolo | Algorithm::KoloBefore => {
                let halving = algorithm == Algorithm::Kolo;
                if self.two_levels(n) && bytes >= KOLO_HIERARCHICAL_MIN {
                    // Inside each host a ring (or MPI's reduce-scatter and allgather,
                    // charged alike), across hosts the flat rule over the hosts.
                    let pieces =
                        crate::transport::choice::hierarchical_pieces(None, bytes as usize, h);
                    if halving && pieces > 1 {
                        return self.pipelined(h, bytes, pieces);
                    }
                    let local = (l - 1) as f64 * self.intra.time(bytes / l as f64);
                    let shard = bytes / l as f64;
                    let cross = match self.kolo_flat(h, shard, true, halving) {
                        Algorithm::Ring => self.ring_across(h, shard, l),
                        a => self.across(a, h, shard, l),
                    };
                    return local + cross + local;
                }
                let a = self.kolo_flat(n, bytes, h > 1, halving);
                self.kolo_sum(a, n, bytes)
            }
            Algorithm::Auto => self.choose(n, bytes).1,
        }
    }

    /// Whether `n` ranks make the hierarchical allreduce's two levels: several hosts
    /// of several ranks each, every host full.
    fn two_levels(&self, n: usize) -> bool {
        let l = self.ranks_per_host.max(1).min(n);
        self.hosts(n) > 1 && l > 1 && n.is_multiple_of(l)
    }

    /// kolo's flat rule: which algorithm a flat sum of `bytes` over `n` ranks takes.
    fn kolo_flat(&self, n: usize, bytes: f64, multi_host: bool, halving: bool) -> Algorithm {
        use crate::transport::choice::{flat_sum, FlatSum};
        let ring_min = if multi_host {
            KOLO_RING_MIN_HOSTS
        } else {
            KOLO_RING_MIN_ONE_HOST
        };
        // Before the halving, the rule was the ring from its minimum, MPI below.
        let way = if halving {
            let auto = crate::vocab::AllreduceAlgorithm::Auto;
            flat_sum(auto, n, bytes as usize, multi_host, ring_min as usize)
        } else if bytes >= ring_min {
            FlatSum::Ring
        } else {
            FlatSum::Mpi
        };
        match way {
            FlatSum::Ring => Algorithm::Ring,
            FlatSum::HalvingDoubling => Algorithm::HalvingDoubling,
            FlatSum::Mpi if bytes <= OMPI_RECURSIVE_DOUBLING_MAX => Algorithm::RecursiveDoubling,
            FlatSum::Mpi => Algorithm::Ring,
        }
    }

    /// `algorithm` over `h` hosts, one rank per host and `flows` such sums per host
    /// at once (the hierarchical allreduce's cross-host step).
    fn across(&self, algorithm: Algorithm, h: usize, bytes: f64, flows: usize) -> f64 {
        let one_per_host = Network {
            ranks_per_host: 1,
            inter: self.inter_for(flows),
            nics_per_host: 1,
            oversubscription: 1.0,
            ..self.clone()
        };
        one_per_host.kolo_sum(algorithm, h, bytes)
    }

    /// `algorithm` as kolo runs it: its halving-doubling stops halving where
    /// `transport::choice::halvings` says and doubles the rest.
    fn kolo_sum(&self, algorithm: Algorithm, n: usize, bytes: f64) -> f64 {
        if algorithm != Algorithm::HalvingDoubling {
            return self.allreduce(algorithm, n, bytes);
        }
        let steps = usize::BITS - 1 - n.max(1).leading_zeros();
        // The steps the model keeps inside a host (distance below the host's size).
        let near = (0..steps)
            .take_while(|&k| self.host(0) == self.host(1 << k))
            .count() as u32;
        let m = crate::transport::choice::halvings(bytes as usize, steps, near);
        self.hybrid(n, bytes, m)
    }

    /// The algorithm [`Algorithm::Auto`] picks for `bytes` over `n` ranks, and its time.
    pub fn choose(&self, n: usize, bytes: f64) -> (Algorithm, f64) {
        [
            Algorithm::Ring,
            Algorithm::Hierarchical,
            Algorithm::HierarchicalPipelined,
            Algorithm::RecursiveDoubling,
            Algorithm::HalvingDoubling,
            Algorithm::Hybrid,
        ]
        .into_iter()
        .map(|a| (a, self.allreduce(a, n, bytes)))
        .fold((Algorithm::Ring, f64::INFINITY), |best, c| {
            if c.1 < best.1 {
                c
            } else {
                best
            }
        })
    }

    /// kolo's pipelined hierarchical allreduce of `bytes` over `h` hosts of
    /// `ranks_per_host` in `pieces` pieces: each piece a ring reduce-scatter in the
    /// host, its 1/L chunk summed across hosts by kolo's flat rule, a ring allgather
    /// in the host; a piece starts once the one before has left the host's
    /// reduce-scatter and at most [`WINDOW`](crate::transport::schedule::WINDOW)
    /// run at once. Each phase first pays its start-ups (its rounds' latencies,
    /// which overlap other pieces' transfers), then moves its bytes, sharing the
    /// host's links (reduce-scatters and allgathers) or the network with the other
    /// pieces moving bytes there at the time (a fluid model: equal shares).
    fn pipelined(&self, h: usize, bytes: f64, pieces: usize) -> f64 {
        let l = self.ranks_per_host.max(1);
        let piece = bytes / pieces as f64;
        let shard = piece / l as f64;
        let local = (
            (l - 1) as f64 * self.intra.latency,
            (l - 1) as f64 * shard / self.intra.bandwidth,
        );
        let phases = [local, self.cross_parts(h, shard, l), local];
        // Per piece: the phase it is in (3: done), and what is left of its start-ups
        // and of its transfer (seconds at the full rate).
        let mut phase = vec![0usize; pieces];
        let mut left: Vec<(f64, f64)> = vec![phases[0]; pieces];
        let mut started = 0;
        let mut t = 0.0;
        loop {
            while started < pieces
                && crate::transport::schedule::admits(started, |j| phase[j] >= 1, |j| phase[j] == 3)
            {
                started += 1;
            }
            let active: Vec<usize> = (0..started).filter(|&i| phase[i] < 3).collect();
            if active.is_empty() {
                return t;
            }
            // Pieces moving bytes on the host's links (phases 0, 2) and the network.
            let sharing = |i: usize| {
                let on_host = phase[i] != 1;
                active
                    .iter()
                    .filter(|&&j| left[j].0 <= 0.0 && (phase[j] != 1) == on_host)
                    .count()
                    .max(1) as f64
            };
            let step = active
                .iter()
                .map(|&i| {
                    if left[i].0 > 0.0 {
                        left[i].0
                    } else {
                        left[i].1 * sharing(i)
                    }
                })
                .fold(f64::INFINITY, f64::min);
            let shares: Vec<f64> = active.iter().map(|&i| sharing(i)).collect();
            t += step;
            for (&i, share) in active.iter().zip(shares) {
                if left[i].0 > 0.0 {
                    left[i].0 -= step;
                } else {
                    left[i].1 -= step / share;
                }
                while phase[i] < 3 && left[i].0 <= 1e-15 && left[i].1 <= 1e-15 {
                    phase[i] += 1;
                    left[i] = phases.get(phase[i]).copied().unwrap_or((0.0, 0.0));
                }
            }
        }
    }

    /// The start-ups and the transfer time (seconds) of the pipeline's cross-host sum
    /// of `bytes` over `h` hosts, `flows` such sums per host at once (by kolo's flat
    /// rule: the ring, or halving-doubling, halving at every step).
    fn cross_parts(&self, h: usize, bytes: f64, flows: usize) -> (f64, f64) {
        if h <= 1 {
            return (0.0, 0.0);
        }
        let link = self.inter_for(flows);
        let (rounds, moved) = match self.kolo_flat(h, bytes, true, true) {
            Algorithm::Ring => (
                2.0 * (h - 1) as f64,
                2.0 * (h - 1) as f64 / h as f64 * bytes,
            ),
            _ => {
                // The pipeline's halving halves at every step (`transport/schedule.rs`)
                // and doubles back; a host count that is not a power of two folds the
                // whole shard in and out.
                let steps = usize::BITS - 1 - h.leading_zeros();
                let fold = if h.is_power_of_two() { 0.0 } else { 2.0 };
                let kept = bytes / 2f64.powi(steps as i32);
                (
                    f64::from(2 * steps) + fold,
                    2.0 * (bytes - kept) + fold * bytes,
                )
            }
        };
        (rounds * link.latency, moved / link.bandwidth)
    }

    /// A ring allreduce of `bytes` over `h` hosts, `flows` of them per host at once.
    fn ring_across(&self, h: usize, bytes: f64, flows: usize) -> f64 {
        if h <= 1 {
            return 0.0;
        }
        2.0 * (h - 1) as f64 * self.inter_for(flows).time(bytes / h as f64)
    }

    /// Halving for the first `m` steps (nearest ranks first), doubling on what is
    /// left for the other steps, doubling back: `m` ≥ the step count is
    /// Rabenseifner's algorithm, `m` = 0 recursive doubling.
    fn hybrid(&self, n: usize, bytes: f64, m: u32) -> f64 {
        let steps = usize::BITS - 1 - n.max(1).leading_zeros();
        let left = bytes / 2f64.powi(m.min(steps) as i32);
        self.butterfly(n, bytes, |k, link| {
            if k < m {
                // A reduce-scatter step sends half of what the rank holds, and the
                // allgather's mirror step as much back.
                2.0 * link.time(bytes / 2f64.powi(k as i32 + 1))
            } else {
                link.time(left)
            }
        })
    }

    /// The α–β lower bound for an allreduce of `bytes` over `n` ranks: information
    /// from every rank must reach every rank (at least ⌈log₂L⌉ intra-host latencies
    /// and ⌈log₂H⌉ inter-host ones), and every host must send and receive at least
    /// 2(H−1)/H of the buffer across hosts through its interfaces, every rank
    /// 2(L−1)/L … of it inside the host (whichever bandwidth term is larger counts;
    /// the latency and bandwidth terms add, as the model's standard bound does).
    pub fn lower_bound(&self, n: usize, bytes: f64) -> f64 {
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let l = self.ranks_per_host.max(1).min(n);
        let h = self.hosts(n);
        let log2 = |x: usize| f64::from(usize::BITS - (x.max(1) - 1).leading_zeros());
        let latency = if h == 1 {
            log2(n) * self.intra.latency
        } else {
            log2(l) * self.intra.latency + log2(h) * self.inter.latency
        };
        let host_out = self.inter_for(l).bandwidth * l as f64;
        let inter_bw = if h > 1 {
            2.0 * (h - 1) as f64 / h as f64 * bytes / host_out
        } else {
            0.0
        };
        let intra_bw = if l > 1 && h == 1 {
            2.0 * (n - 1) as f64 / n as f64 * bytes / self.intra.bandwidth
        } else {
            0.0
        };
        latency + inter_bw.max(intra_bw)
    }

    /// Seconds for the cycle agreement over `n` ranks with `bytes` per message: the
    /// recursive doubling kolo's transport runs (`MpiTransport::agree_bits`).
    pub fn agreement(&self, n: usize, bytes: f64) -> f64 {
        self.butterfly(n, bytes, |_, link| link.time(bytes))
    }

    /// Seconds for the full exchange over `n` ranks where rank r contributes
    /// `lens[r]` bytes: an allgather of the lengths (Bruck: ⌈log₂N⌉ steps) then an
    /// allgatherv of the bytes, modelled as Open MPI's classic rule for it (Bruck
    /// below 50 kB in all, else the ring for an odd N and neighbour exchange for an
    /// even one).
    pub fn exchange(&self, lens: &[usize]) -> f64 {
        let n = lens.len();
        if n <= 1 {
            return 0.0;
        }
        let doubling = |each: f64| move |k: u32, link: Link| link.time(each * 2f64.powi(k as i32));
        let lengths = self.butterfly(n, 8.0, doubling(8.0));
        let total: usize = lens.iter().sum();
        let largest = lens.iter().copied().max().unwrap_or(0) as f64;
        let gather = if total < 50_000 {
            // Bruck: step k forwards 2^k contributions.
            self.butterfly(n, largest, doubling(largest))
        } else {
            // Ring (odd N) or neighbour exchange (even N): every contribution moves
            // one hop per step, so a step lasts as long as the largest takes.
            let hop = if self.hosts(n) > 1 {
                self.inter_for(1)
            } else {
                self.intra
            };
            if n % 2 == 1 {
                (n - 1) as f64 * hop.time(largest)
            } else {
                (n / 2) as f64 * hop.time(2.0 * largest)
            }
        };
        lengths + gather
    }
}

impl crate::transport::sim::ControlCosts for Network {
    fn agreement(&self, n: usize, bytes: f64) -> f64 {
        Network::agreement(self, n, bytes)
    }

    fn exchange(&self, lens: &[usize]) -> f64 {
        Network::exchange(self, lens)
    }

    fn ranks_per_host(&self) -> usize {
        self.ranks_per_host
    }

    fn cpu_scale(&self) -> f64 {
        self.cpu_scale
    }
}

#[cfg(test)]
mod tests;
