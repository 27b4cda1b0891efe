//! Negotiation: which requests are ready on every rank, checked for agreement.
//!
//! Every rank runs an identical [`Negotiator`] and feeds it the same messages (the
//! cycle's exchange gives every rank every rank's [`CycleMsg`], in rank order), so
//! every rank reaches the same responses in the same order without a coordinator.
//! It is a plain state machine: no threads, no MPI, unit-tested below.

use std::borrow::Borrow;
use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::request::{CycleMsg, Key, OpKind, RequestMeta};
use crate::error::Error;

/// A request that every rank (or, for joined ranks, their stand-in zeros) is ready to run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ready {
    pub(crate) key: Key,
    pub(crate) kind: OpKind,
    /// Each rank's request; `None` for a joined rank that did not submit it. Shared:
    /// a cached response hands every rank the same requests without copying them.
    pub(crate) metas: Metas,
}

/// Every rank's request of a response, in rank order, shared between the response
/// cache and each cycle's responses.
pub(crate) type Metas = Arc<[Option<Arc<RequestMeta>>]>;

impl Ready {
    /// The request of the lowest rank that submitted it (all agree after the checks).
    pub(crate) fn first(&self) -> &Arc<RequestMeta> {
        // The constructor only builds a Ready with at least one submission.
        self.metas
            .iter()
            .flatten()
            .next()
            .unwrap_or_else(|| unreachable!("Ready without requests"))
    }
}

/// What the engine must do, in this order, on every rank.
#[derive(Debug)]
pub(crate) enum Response {
    Run(Ready),
    /// A cached single-tensor f32 sum or average that every rank reduced in the
    /// cycle's agreement itself: `sum` is the sum of the prescaled tensors; only the
    /// postscale is left to apply.
    Reduced {
        ready: Ready,
        /// Inline up to four values: a latency-bound op's sum allocates nothing.
        sum: smallvec::SmallVec<[f32; 4]>,
    },
    Fail {
        key: Key,
        error: Error,
    },
    JoinDone {
        last: usize,
    },
}

/// The result of one cycle.
#[derive(Debug)]
pub(crate) enum Outcome {
    Responses(Vec<Response>),
    /// A rank shut down: nothing more can run; every pending op fails naming it.
    RankLeft(usize),
    /// A rank's stall inspector gave up: every pending op fails with this report.
    Stalled(String),
}

struct Entry {
    /// Each rank's request: ranks that sent the same message share one.
    metas: Vec<Option<Arc<RequestMeta>>>,
    since: Instant,
}

impl Entry {
    /// The ranks this entry needs when not every rank: a device turn's process set
    /// (from whichever of its ranks announced it first).
    fn among(&self) -> Option<&[usize]> {
        self.metas.iter().flatten().next()?.participants()
    }

    /// Whether every rank it needs has submitted it (a joined rank stands in with
    /// zeros for a collective).
    fn ready(&self, joined: &[bool]) -> bool {
        match self.among() {
            Some(among) => among
                .iter()
                .all(|&r| self.metas.get(r).is_some_and(Option::is_some)),
            None => self
                .metas
                .iter()
                .zip(joined)
                .all(|(m, &j)| m.is_some() || j),
        }
    }

    /// The ranks it needs that have not submitted it.
    fn missing(&self, joined: &[bool]) -> Vec<usize> {
        match self.among() {
            Some(among) => among
                .iter()
                .copied()
                .filter(|&r| self.metas.get(r).is_some_and(Option::is_none))
                .collect(),
            None => (0..self.metas.len())
                .filter(|&r| self.metas[r].is_none() && !joined[r])
                .collect(),
        }
    }
}

/// The table of requests seen from all ranks and not yet run.
pub(crate) struct Negotiator {
    size: usize,
    /// Entries in order of first submission, which is the order they run in.
    table: BTreeMap<u64, Entry>,
    by_key: FxHashMap<Key, u64>,
    next_seq: u64,
    joined: Vec<bool>,
    last_joined: usize,
}

impl Negotiator {
    pub(crate) fn new(size: usize) -> Self {
        Negotiator {
            size,
            table: BTreeMap::new(),
            by_key: FxHashMap::default(),
            next_seq: 0,
            joined: vec![false; size],
            last_joined: 0,
        }
    }

    /// Whether a request from some rank is waiting for others (this rank included).
    pub(crate) fn has_entries(&self) -> bool {
        !self.table.is_empty()
    }

    /// Whether any request from any rank is waiting.
    #[cfg(test)]
    pub(crate) fn has_pending(&self) -> bool {
        !self.table.is_empty() || self.joined.iter().any(|&j| j)
    }

    /// Whether some rank has joined and not every rank has yet.
    pub(crate) fn any_joined(&self) -> bool {
        self.joined.iter().any(|&j| j)
    }

    /// Records `msg`, the message every rank of `ranks` sent.
    fn take(&mut self, msg: &CycleMsg, ranks: std::ops::Range<usize>, now: Instant) {
        for req in &msg.requests {
            if req.kind == OpKind::Join {
                for rank in ranks.clone() {
                    self.joined[rank] = true;
                    self.last_joined = rank;
                }
                continue;
            }
            let seq = *self.by_key.entry(req.key.clone()).or_insert_with(|| {
                let s = self.next_seq;
                self.next_seq += 1;
                s
            });
            let size = self.size;
            let entry = self.table.entry(seq).or_insert_with(|| Entry {
                metas: vec![None; size],
                since: now,
            });
            let shared = Arc::new(req.clone());
            for rank in ranks.clone() {
                if entry.metas[rank].is_some() {
                    // Submit-time checks on each rank make this impossible.
                    tracing::error!(key = %req.key, rank, "duplicate request reached negotiation");
                    continue;
                }
                entry.metas[rank] = Some(shared.clone());
            }
        }
    }

    /// Takes one cycle's messages (index = rank) and returns what to run. Entries
    /// that are the same object (an `Arc` handed to several ranks) are taken as one.
    pub(crate) fn handle<M: Borrow<CycleMsg>>(&mut self, msgs: &[M], now: Instant) -> Outcome {
        if let Some(rank) = msgs.iter().position(|m| m.borrow().shutdown) {
            self.table.clear();
            self.by_key.clear();
            return Outcome::RankLeft(rank);
        }
        if let Some(rank) = msgs.iter().position(|m| m.borrow().stall_abort) {
            let report = self.stall_report(rank);
            self.table.clear();
            self.by_key.clear();
            return Outcome::Stalled(report);
        }
        let mut responses = Vec::new();
        // Ranks that sent the same message (the exchange hands one decoded message to
        // every rank that sent those bytes: in a data-parallel job, usually all) are
        // taken together, their requests shared: at thousands of ranks each request
        // costs a pointer per rank here instead of a copy, a lookup and a check.
        let mut rank = 0;
        while rank < msgs.len() {
            let msg: &CycleMsg = msgs[rank].borrow();
            let run = msgs[rank..]
                .iter()
                .take_while(|m| std::ptr::eq((*m).borrow(), msg))
                .count();
            self.take(msg, rank..rank + run, now);
            rank += run;
        }
        let joined = self.joined.clone();
        let ready: Vec<u64> = self
            .table
            .iter()
            .filter(|(_, e)| e.ready(&joined))
            .map(|(&seq, _)| seq)
            .collect();
        let joined_ranks: Vec<usize> = (0..self.size).filter(|&r| joined[r]).collect();
        for seq in ready {
            let Some(entry) = self.table.remove(&seq) else {
                continue;
            };
            let Some(first) = entry.metas.iter().flatten().next() else {
                continue;
            };
            let key = first.key.clone();
            self.by_key.remove(&*key);
            let kind = first.kind;
            responses.push(match check(&key, &entry.metas, &joined_ranks) {
                Ok(()) => Response::Run(Ready {
                    key,
                    kind,
                    metas: entry.metas.into_iter().collect(),
                }),
                Err(error) => Response::Fail { key, error },
            });
        }
        responses.extend(self.mismatched_groups(&joined));
        if self.joined.iter().all(|&j| j) {
            responses.push(Response::JoinDone {
                last: self.last_joined,
            });
            self.joined = vec![false; self.size];
        }
        Outcome::Responses(responses)
    }

    /// Groups whose member lists differ between ranks: each group is keyed by its
    /// member names, so such groups never become ready. A member that every rank
    /// (but joined ones) submitted in some group, each rank in exactly one of two or
    /// more different groups, is such a mismatch: those groups fail on every rank,
    /// naming the member and what each rank sent. (A rank with the member in two
    /// pending groups at once is not judged: it may be submitting in another order.)
    fn mismatched_groups(&mut self, joined: &[bool]) -> Vec<Response> {
        let grouped = |k: OpKind| {
            matches!(
                k,
                OpKind::GroupedAllreduce | OpKind::GroupedAllgather | OpKind::GroupedReducescatter
            )
        };
        // Member name → the pending groups holding it.
        let mut holders: FxHashMap<Key, Vec<u64>> = FxHashMap::default();
        for (&seq, e) in &self.table {
            let Some(first) = e.metas.iter().flatten().next() else {
                continue;
            };
            if !grouped(first.kind) {
                continue;
            }
            for t in &first.tensors {
                holders.entry(t.name.clone()).or_default().push(seq);
            }
        }
        let mut failed: Vec<u64> = Vec::new();
        let mut responses = Vec::new();
        let mut members: Vec<(&Key, &Vec<u64>)> =
            holders.iter().filter(|(_, seqs)| seqs.len() > 1).collect();
        members.sort_by(|a, b| a.0.cmp(b.0));
        for (member, seqs) in members {
            if seqs.iter().any(|s| failed.contains(s)) {
                continue;
            }
            // Which group each rank sent the member in; None: none yet.
            let mut of_rank: Vec<Option<u64>> = vec![None; self.size];
            let mut twice = false;
            for &seq in seqs {
                let Some(e) = self.table.get(&seq) else {
                    continue;
                };
                for (r, m) in e.metas.iter().enumerate() {
                    if m.is_some() {
                        twice |= of_rank[r].is_some();
                        of_rank[r] = Some(seq);
                    }
                }
            }
            let covered = of_rank.iter().zip(joined).all(|(g, &j)| g.is_some() || j);
            if twice || !covered {
                continue;
            }
            let lists = of_rank.iter().enumerate().filter_map(|(r, g)| {
                let m = self.table.get(&(*g)?)?.metas[r].as_ref()?;
                let names: Vec<&str> = m.tensors.iter().map(|t| &*t.name).collect();
                Some((r, format!("{names:?}")))
            });
            // The groups differ (their keys are their member lists): two values at least.
            let sent = ranks_sent(lists, String::clone).unwrap_or_default();
            for &seq in seqs {
                let Some(e) = self.table.remove(&seq) else {
                    continue;
                };
                let Some(first) = e.metas.iter().flatten().next() else {
                    continue;
                };
                let key = first.key.clone();
                self.by_key.remove(&*key);
                failed.push(seq);
                responses.push(Response::Fail {
                    error: Error::Mismatch {
                        op: first.kind.name(),
                        name: key.to_string(),
                        message: format!(
                            "group members mismatch: member {:?} is in different groups: {}",
                            &**member, sent
                        ),
                    },
                    key,
                });
            }
        }
        responses
    }

    /// Which ranks are missing which requests, for the error every rank reports when
    /// `by_rank`'s stall inspector gives up (the table is the same on every rank).
    fn stall_report(&self, by_rank: usize) -> String {
        let mut parts = Vec::new();
        for e in self.table.values() {
            let Some(first) = e.metas.iter().flatten().next() else {
                continue;
            };
            let missing = e.missing(&self.joined);
            if !missing.is_empty() {
                parts.push(format!("{:?} is missing from ranks {missing:?}", first.key));
            }
        }
        format!(
            "stalled: {} (rank {by_rank} reached the stall shutdown time)",
            if parts.is_empty() {
                "no request is missing".to_string()
            } else {
                parts.join("; ")
            }
        )
    }

    /// Requests that some ranks submitted more than `after` ago and others have not,
    /// with the missing ranks.
    pub(crate) fn stalled(&self, now: Instant, after: Duration) -> Vec<(String, Vec<usize>)> {
        self.table
            .values()
            .filter(|e| now.duration_since(e.since) >= after)
            .filter_map(|e| {
                let key = e.metas.iter().flatten().next()?.key.to_string();
                Some((key, e.missing(&self.joined)))
            })
            .collect()
    }
}

/// Lists who sent what when the ranks disagree on `what(meta)`, e.g.
/// `rank 0 sent [17, 17], ranks 1, 2 sent [18, 18]`; `None` when all agree.
fn differ<T: PartialEq>(
    metas: &[Option<Arc<RequestMeta>>],
    what: impl Fn(&RequestMeta) -> T,
    show: impl Fn(&T) -> String,
) -> Option<String> {
    ranks_sent(
        metas
            .iter()
            .enumerate()
            .filter_map(|(rank, m)| Some((rank, what(m.as_deref()?)))),
        show,
    )
}

/// The ranks grouped by the value each sent, in order of first appearance, as
/// `rank 0 sent X, ranks 1, 2 sent Y`; `None` when they all sent the same.
fn ranks_sent<T: PartialEq>(
    sent: impl IntoIterator<Item = (usize, T)>,
    show: impl Fn(&T) -> String,
) -> Option<String> {
    let mut groups: Vec<(T, Vec<usize>)> = Vec::new();
    for (rank, v) in sent {
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((v, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return None;
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(v, ranks)| {
            let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {} sent {}", list.join(", "), show(v))
        })
        .collect();
    Some(parts.join(", "))
}

fn debug<T: Debug>(v: &T) -> String {
    format!("{v:?}")
}

/// The checks across ranks made before an op runs (dtype, op, shape, reduce op,
/// scale factors, root, device), in the order a user would want them reported.
fn check(key: &str, metas: &[Option<Arc<RequestMeta>>], joined: &[usize]) -> Result<(), Error> {
    let first = metas
        .iter()
        .flatten()
        .next()
        .ok_or_else(|| Error::Internal(format!("{key:?}: no requests")))?;
    let kind = first.kind;
    // Every rank sent the same request (shared, or equal): nothing can differ, and the
    // checks below (each of which builds a value per rank) need not run.
    let same = metas
        .iter()
        .flatten()
        .all(|m| Arc::ptr_eq(m, first) || **m == **first);
    if same && kind == OpKind::DeviceTurn {
        return Ok(());
    }
    let fail = |what: &str, message: String| Error::Mismatch {
        op: kind.name(),
        name: key.to_string(),
        message: format!("{what} mismatch: {message}"),
    };
    if kind == OpKind::DeviceTurn {
        // Internal: the same set's engines ask under one key; the ranks of a joined
        // job do not matter to it (only the set's ranks take part).
        return match differ(metas, |m| (m.kind, m.splits.clone()), debug) {
            Some(m) => Err(fail("device turn", m)),
            None => Ok(()),
        };
    }
    if !same {
        if let Some(m) = differ(metas, |m| m.kind, |k| k.name().to_string()) {
            return Err(fail("op", m));
        }
    }
    if !joined.is_empty() && !kind.runs_with_joined_ranks() {
        return Err(Error::Joined {
            op: kind.name(),
            name: key.to_string(),
            ranks: joined.to_vec(),
        });
    }
    if same {
        return Ok(());
    }
    if let Some(m) = differ(metas, |m| m.device, |d| d.name().to_string()) {
        return Err(fail("device", m));
    }
    if let Some(m) = differ(
        metas,
        |m| m.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
        debug,
    ) {
        return Err(fail("group members", m));
    }
    if let Some((what, m)) =
        tensors_differ(metas, first.tensors.len(), kind).or_else(|| settings_differ(metas, kind))
    {
        return Err(fail(what, m));
    }
    Ok(())
}

/// The first of a request's tensors whose dtype or shape differs between ranks, as
/// (what, message): the full shape, or for allgather and alltoall every dim but the
/// first. A group's message names the member.
fn tensors_differ(
    metas: &[Option<Arc<RequestMeta>>],
    tensors: usize,
    kind: OpKind,
) -> Option<(&'static str, String)> {
    let grouped = matches!(
        kind,
        OpKind::GroupedAllreduce | OpKind::GroupedAllgather | OpKind::GroupedReducescatter
    );
    let first = metas.iter().flatten().next()?;
    for i in 0..tensors {
        let named = |m: String| match first.tensors.get(i) {
            Some(t) if grouped => format!("member {:?}: {m}", &*t.name),
            _ => m,
        };
        if let Some(m) = differ(metas, |m| m.tensors[i].dtype, |d| d.to_string()) {
            return Some(("dtype", named(m)));
        }
        let shape = |m: &RequestMeta| m.tensors[i].shape.clone();
        match kind {
            OpKind::Allgather | OpKind::GroupedAllgather | OpKind::Alltoall => {
                let tail = |m: &RequestMeta| {
                    let s = &m.tensors[i].shape;
                    (s.len(), s.get(1..).map(<[usize]>::to_vec))
                };
                if differ(metas, tail, |_| String::new()).is_some() {
                    let m = differ(metas, shape, debug).unwrap_or_default();
                    return Some((
                        "shape",
                        named(format!("{m} (all dims but the first must match)")),
                    ));
                }
            }
            _ => {
                if let Some(m) = differ(metas, shape, debug) {
                    return Some(("shape", named(m)));
                }
            }
        }
    }
    None
}

/// The op's settings that differ between ranks, as (what, message): reduce op and
/// scale factors of reductions, a process set's ranks, a broadcast's root.
fn settings_differ(
    metas: &[Option<Arc<RequestMeta>>],
    kind: OpKind,
) -> Option<(&'static str, String)> {
    if matches!(
        kind,
        OpKind::Allreduce
            | OpKind::GroupedAllreduce
            | OpKind::Reducescatter
            | OpKind::GroupedReducescatter
    ) {
        if let Some(m) = differ(metas, |m| m.op, debug) {
            return Some(("reduce op", m));
        }
        // Scale factors are finite (checked at submit), so float equality is exact here.
        if let Some(m) = differ(metas, |m| m.prescale, |v| v.to_string()) {
            return Some(("prescale", m));
        }
        if let Some(m) = differ(metas, |m| m.postscale, |v| v.to_string()) {
            return Some(("postscale", m));
        }
    }
    if kind == OpKind::AddProcessSet {
        if let Some(m) = differ(
            metas,
            |m| m.splits.clone(),
            |s| format!("ranks {:?}", s.clone().unwrap_or_default()),
        ) {
            return Some(("process set", m));
        }
    }
    if kind == OpKind::Broadcast {
        if let Some(m) = differ(metas, |m| m.root, |r| format!("root {r}")) {
            return Some(("root", m));
        }
    }
    None
}

#[cfg(test)]
mod tests;
