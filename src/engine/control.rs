//! The negotiation step of a cycle: from this rank's inbox, the response cache, the
//! negotiator and the stall inspector to the responses every rank runs, in the same
//! order everywhere (the protocol is in `README.md`).

use std::time::{Duration, Instant};

use super::autotune::Settings;
use super::cache::{self, ResponseCache};
use super::negotiate::{self, Outcome, Response};
use super::request::CycleMsg;
use super::{Control, Inbox};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// What a cycle's negotiation decided.
#[derive(Debug)]
pub(super) enum Negotiation {
    /// A rank left: nothing runs, and this engine stops communicating.
    RankLeft(usize),
    /// The responses to run, and settings the tuner made every rank switch to.
    Ready {
        responses: Vec<Response>,
        tuning: Option<Settings>,
    },
}

impl Control {
    /// Runs one cycle's negotiation over `t`: announces `inbox`'s new requests (by
    /// cache slot where the cache knows them), sends `tuning` (rank 0's new settings)
    /// if any, and returns what every rank agreed to run. `poll` runs while waiting
    /// for other ranks (the GPU plane completes its ops there).
    pub(super) fn negotiate(
        &mut self,
        t: &mut dyn Transport,
        inbox: &mut Inbox,
        tuning: &mut Option<Settings>,
        poll: &mut dyn FnMut(),
    ) -> Result<Negotiation> {
        Negotiate {
            t,
            inbox,
            control: self,
            tuning,
            poll,
        }
        .run()
    }
}

/// What one negotiation borrows from the engine.
struct Negotiate<'a> {
    t: &'a mut dyn Transport,
    inbox: &'a mut Inbox,
    control: &'a mut Control,
    tuning: &'a mut Option<Settings>,
    poll: &'a mut dyn FnMut(),
}

impl Negotiate<'_> {
    /// Negotiation: the cache-bit agreement and the full exchange as needed, then the
    /// responses every rank runs, in the same order everywhere.
    fn run(&mut self) -> Result<Negotiation> {
        let use_cache = self.control.cache.enabled() && !self.control.negotiator.any_joined();
        if use_cache {
            self.announce_cached();
        } else {
            self.inbox.unannounce_all();
        }
        let (cached_ready, someone_has_full) = self.exchange_bits(use_cache)?;
        let msgs = if someone_has_full {
            self.exchange_full()?
        } else {
            Vec::new()
        };
        let now = Instant::now();
        let mut responses = self.cached_responses(cached_ready)?;
        let mut stale = Vec::new();
        if !msgs.is_empty() {
            // A full request under a cached name means its request changed (or it was
            // demoted by the stall inspector): forget the slot everywhere.
            for m in &msgs {
                for r in &m.requests {
                    if let Some(slot) = self.control.cache.invalidate(&r.key) {
                        stale.push(slot);
                    }
                }
            }
            match self.control.negotiator.handle(&msgs, now) {
                Outcome::RankLeft(left) => {
                    self.inbox.fail_all(|m| Error::RankLeft {
                        op: m.kind.name(),
                        name: m.key.to_string(),
                        rank: left,
                    });
                    return Ok(Negotiation::RankLeft(left));
                }
                Outcome::Stalled(report) => {
                    tracing::error!(rank = self.inbox.rank, "{report}");
                    return Err(Error::Stalled { report });
                }
                Outcome::Responses(negotiated) => {
                    let cache_new = use_cache && !self.control.negotiator.any_joined();
                    for r in &negotiated {
                        if let Response::Run(ready) = r {
                            if cache_new && ResponseCache::cacheable(ready.kind) {
                                if let Some(slot) = self.control.cache.insert(ready.metas.clone()) {
                                    stale.push(slot);
                                }
                            }
                        }
                    }
                    responses.extend(negotiated);
                }
            }
        }
        // Requests announced by a slot that no longer holds them go out in full.
        for slot in stale {
            self.inbox.announce_in_full(slot);
        }
        self.control.last_cycle_had_news =
            !responses.is_empty() || msgs.iter().any(|m| !m.requests.is_empty());
        tracing::trace!(
            rank = self.inbox.rank,
            full_exchange = someone_has_full,
            ready = responses.len(),
            "negotiation cycle"
        );
        Ok(Negotiation::Ready {
            responses,
            tuning: msgs.first().and_then(|m| m.tuning),
        })
    }

    /// Phase 1 (with the cache): one AND of `[flags, cache bits]` across ranks. Returns
    /// the cache slots ready on every rank and whether any rank has something the cache
    /// cannot say (then the full exchange follows).
    fn exchange_bits(&mut self, use_cache: bool) -> Result<(Vec<usize>, bool)> {
        if !use_cache {
            return Ok((Vec::new(), true));
        }
        let has_full = !self.inbox.outgoing.is_empty()
            || self.inbox.shutting_down
            || self.control.stall_abort
            || self.tuning.is_some();
        let mut words = vec![0u64; 1 + self.control.cache.words()];
        words[0] = u64::from(!has_full);
        for &slot in self.inbox.announced.keys() {
            cache::set_bit(&mut words[1..], slot);
        }
        self.while_waiting(|t, idle| t.agree_bits(&mut words, idle))?;
        Ok((cache::bits(&words[1..]).collect(), words[0] & 1 == 0))
    }

    /// Phase 2: every rank's new requests and flags, in rank order.
    fn exchange_full(&mut self) -> Result<Vec<CycleMsg>> {
        let requests = std::mem::take(&mut self.inbox.outgoing)
            .iter()
            .filter_map(|k| self.inbox.pending.get(k).map(|r| r.meta.clone()))
            .collect();
        let msg = CycleMsg {
            requests,
            shutdown: self.inbox.shutting_down,
            stall_abort: self.control.stall_abort,
            tuning: self.tuning.take(),
        };
        self.full_exchange(&msg)
    }

    /// The responses of cache slots every rank agreed on.
    fn cached_responses(&mut self, slots: Vec<usize>) -> Result<Vec<Response>> {
        let mut responses = Vec::with_capacity(slots.len());
        for slot in slots {
            let Some((metas, key, kind)) = self.control.cache.metas(slot).and_then(|metas| {
                let first = metas.iter().flatten().next()?;
                Some((metas.clone(), first.key.clone(), first.kind))
            }) else {
                return Err(Error::Internal(format!(
                    "cache slot {slot} agreed but empty"
                )));
            };
            self.control.cache.touch(slot);
            self.inbox.announced.remove(&slot);
            responses.push(Response::Run(negotiate::Ready { key, kind, metas }));
        }
        Ok(responses)
    }

    /// Moves new requests that hit the cache from the full list to bits, and demotes
    /// bit-announced requests that have waited long enough to be worth a full
    /// announcement (so that the stall inspector sees, and can name, missing ranks).
    fn announce_cached(&mut self) {
        let outgoing = std::mem::take(&mut self.inbox.outgoing);
        for key in outgoing {
            let slot = self.inbox.pending.get(&key).and_then(|r| {
                ResponseCache::cacheable(r.meta.kind)
                    .then(|| self.control.cache.lookup(&r.meta, self.inbox.rank))
                    .flatten()
            });
            match slot {
                Some(slot) => {
                    self.inbox.announced.insert(slot, key);
                }
                None => self.inbox.outgoing.push(key),
            }
        }
        // Looking at every bit-announced request's age is not free with thousands of
        // them: do it a few times per stall interval, not every cycle.
        let now = Instant::now();
        if self.control.stall.enabled() && now >= self.control.next_demotion_scan {
            let limit = self.control.stall.after() / 2;
            self.control.next_demotion_scan = now + limit / 4;
            let old: Vec<usize> = self
                .inbox
                .announced
                .iter()
                .filter(|(_, key)| {
                    self.inbox
                        .pending
                        .get(*key)
                        .is_some_and(|r| r.submitted.elapsed() > limit)
                })
                .map(|(&slot, _)| slot)
                .collect();
            for slot in old {
                self.inbox.announce_in_full(slot);
            }
        }
    }

    /// Runs a control-plane collective; while it waits for other ranks the engine keeps
    /// taking in work, completes GPU ops whose events fired, and lets the stall
    /// inspector warn.
    fn while_waiting<R>(
        &mut self,
        call: impl FnOnce(&mut dyn Transport, &mut dyn FnMut(Duration)) -> Result<R>,
    ) -> Result<R> {
        let Negotiate {
            t,
            inbox,
            control: Control { stall, .. },
            poll,
            ..
        } = self;
        call(&mut **t, &mut |waited| {
            inbox.drain();
            poll();
            stall.check_while_waiting(waited, &inbox.pending);
        })
    }

    /// Every rank's [`CycleMsg`], in rank order.
    fn full_exchange(&mut self, msg: &CycleMsg) -> Result<Vec<CycleMsg>> {
        let bytes = postcard::to_stdvec(msg)
            .map_err(|e| Error::Internal(format!("encoding a cycle message: {e}")))?;
        let all = self.while_waiting(|t, idle| t.exchange(&bytes, idle))?;
        all.iter()
            .enumerate()
            .map(|(r, b)| {
                postcard::from_bytes::<CycleMsg>(b)
                    .map_err(|e| Error::Internal(format!("decoding rank {r}'s cycle message: {e}")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::{Control, Negotiation};
    use crate::config::Config;
    use crate::engine::negotiate::Response;
    use crate::engine::queue::Queue;
    use crate::engine::request::{Command, OpKind, Request, RequestMeta};
    use crate::engine::{Agreed, Inbox};
    use crate::error::Error;
    use crate::handle::{self, Handle, PendingNames};
    use crate::loopback_tests::on_loopback_ranks;
    use crate::tensor::{DType, Tensor};
    use crate::transport::loopback::Loopback;
    use crate::transport::Transport;
    use crate::vocab::ReduceOp;

    /// One rank's negotiation state over its end of an in-process job.
    struct Rank {
        control: Control,
        inbox: Inbox,
        t: Loopback,
    }

    impl Rank {
        fn new(t: Loopback, cache_capacity: usize) -> Self {
            let topology = t.topology();
            let agreed = Agreed {
                fusion_threshold: 1 << 20,
                cache_capacity,
                autotune: false,
                hierarchical_allreduce: false,
                hierarchical_allgather: false,
            };
            let control = Control::new(&Config::default(), topology, agreed);
            let inbox = Inbox::new(Arc::new(Queue::default()), topology.rank);
            Rank { control, inbox, t }
        }

        /// Submits an f32 allreduce of `shape` under `key`.
        fn submit(&mut self, key: &str, shape: &[usize]) -> Handle<Tensor> {
            let meta =
                RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, shape, ReduceOp::Sum);
            let names: Arc<dyn PendingNames> = self.inbox.queue.clone();
            let (h, done) = handle::pair(
                smallvec::smallvec![meta.key.clone()],
                names,
                ("allreduce", self.inbox.rank),
                handle::to_tensor,
            );
            let n = shape.iter().product();
            self.inbox.accept(Command::Submit(Request {
                meta,
                tensors: smallvec::smallvec![Tensor::zeros(DType::F32, &[n])],
                done,
                submitted: Instant::now(),
            }));
            h
        }

        /// One negotiation: the keys ready to run (their requests leave the inbox, as
        /// the executor would take them), with the shape agreed for each.
        fn cycle(&mut self) -> Result<Vec<(String, Vec<usize>)>, Negotiation> {
            let negotiated = self
                .control
                .negotiate(&mut self.t, &mut self.inbox, &mut None, &mut || {})
                .unwrap();
            let responses = match negotiated {
                Negotiation::Ready { responses, .. } => responses,
                left => return Err(left),
            };
            Ok(responses
                .into_iter()
                .map(|r| match r {
                    Response::Run(ready) => {
                        self.inbox.pending.remove(&*ready.key);
                        let shape = ready.first().tensors[0].shape.to_vec();
                        (ready.key.to_string(), shape)
                    }
                    other => panic!("unexpected response {other:?}"),
                })
                .collect())
        }
    }

    /// Runs `script` on each rank of an in-process job of two, each with its own
    /// negotiation state.
    fn two_ranks<T: Send>(cache: usize, script: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
        on_loopback_ranks(2, |_, t| script(&mut Rank::new(t, cache)))
    }

    fn keys(ready: &[(String, Vec<usize>)]) -> Vec<&str> {
        ready.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn a_request_runs_once_every_rank_has_it_in_one_order_everywhere() {
        let out = two_ranks(0, |r| {
            let mine: &[&str] = if r.inbox.rank == 0 {
                &["a", "b", "c"]
            } else {
                &["c", "a"]
            };
            for k in mine {
                r.submit(k, &[2]);
            }
            let first = r.cycle().unwrap();
            if r.inbox.rank == 1 {
                r.submit("b", &[2]);
            }
            let second = r.cycle().unwrap();
            (first, second)
        });
        assert_eq!(
            out[0], out[1],
            "both ranks run the same responses in the same order"
        );
        let (first, second) = &out[0];
        let mut first = keys(first);
        first.sort_unstable();
        assert_eq!(first, ["a", "c"]);
        assert_eq!(keys(second), ["b"]);
    }

    #[test]
    fn a_repeated_request_is_agreed_by_its_cache_bit_and_a_new_shape_goes_out_in_full() {
        let out = two_ranks(8, |r| {
            let mut calls = Vec::new();
            let mut cycle = |r: &mut Rank| {
                let before = r.t.calls();
                let ready = r.cycle().unwrap();
                calls.push(r.t.calls() - before);
                ready
            };
            r.submit("x", &[4]);
            let first = cycle(r);
            r.submit("x", &[4]);
            let cached = cycle(r);
            // Only rank 0 asks again: the bit is not set everywhere, nothing runs.
            if r.inbox.rank == 0 {
                r.submit("x", &[4]);
            }
            let waiting = cycle(r);
            if r.inbox.rank == 1 {
                r.submit("x", &[4]);
            }
            let late = cycle(r);
            r.submit("x", &[5]);
            let reshaped = cycle(r);
            (vec![first, cached, waiting, late, reshaped], calls)
        });
        assert_eq!(out[0], out[1]);
        let (ready, calls) = &out[0];
        let x = |n: usize| vec![("x".to_string(), vec![n])];
        assert_eq!(ready, &[x(4), x(4), vec![], x(4), x(5)]);
        // A cycle is the bit agreement, plus the full exchange when some rank has a
        // request the cache cannot name.
        assert_eq!(calls, &[2, 1, 1, 1, 2]);
    }

    #[test]
    fn a_rank_that_shuts_down_is_named_and_pending_requests_fail_with_its_rank() {
        let out = two_ranks(8, |r| {
            let h = r.submit("y", &[1]);
            if r.inbox.rank == 1 {
                r.inbox.shutting_down = true;
            }
            let left = match r.cycle() {
                Err(Negotiation::RankLeft(left)) => left,
                Err(_) => panic!("expected RankLeft"),
                Ok(ready) => panic!("ran {ready:?} although rank 1 left"),
            };
            (left, h.wait().map(|_| ()))
        });
        assert_eq!(out[0].0, 1);
        match &out[0].1 {
            Err(Error::RankLeft { rank: 1, name, .. }) => assert_eq!(name, "y"),
            other => panic!("expected rank 1 named, got {other:?}"),
        }
    }
}
