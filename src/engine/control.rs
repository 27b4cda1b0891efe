//! The negotiation step of a cycle: from this rank's inbox, the response cache, the
//! negotiator and the stall inspector to the responses every rank runs, in the same
//! order everywhere (the protocol is in `README.md`).

use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::cache::{self, ResponseCache};
use super::layout::scale_bytes;
use super::negotiate::{self, Outcome, Response};
use super::request::Settings;
use super::request::{CycleMsg, Device, OpKind};
use super::{Control, Inbox};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::transport::Transport;
use crate::vocab::ReduceOp;

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

/// Most ops reduced speculatively in one cycle's agreement.
const SPEC_SLOTS: usize = 4;
/// f32 values the agreement carries for them (512 bytes per message).
const SPEC_VALUES: usize = 128;
/// Speculation is tried only when at most this many cached ops are ready.
const SPEC_SCAN: usize = 16;

/// Where a speculated op sits in the agreement's sum.
#[derive(Debug, Clone, Copy)]
struct Spec {
    slot: usize,
    at: usize,
    len: usize,
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
        let (cached_ready, someone_has_full, mut responses) = self.exchange_bits(use_cache)?;
        let msgs = if someone_has_full {
            self.exchange_full()?
        } else {
            Vec::new()
        };
        let now = Instant::now();
        responses.extend(self.cached_responses(cached_ready)?);
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
                        tensors: Vec::new(),
                    });
                    return Ok(Negotiation::RankLeft(left));
                }
                Outcome::Stalled(report) => {
                    tracing::error!(rank = self.inbox.rank, "{report}");
                    return Err(Error::Stalled {
                        report,
                        tensors: Vec::new(),
                    });
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

    /// Phase 1 (with the cache): one AND of `[flags, cache bits, speculated slots]`
    /// across ranks, which also sums the small ops this rank speculates on. Returns
    /// the cache slots ready on every rank, whether any rank has something the cache
    /// cannot say (then the full exchange follows), and the ops already reduced.
    fn exchange_bits(&mut self, use_cache: bool) -> Result<(Vec<usize>, bool, Vec<Response>)> {
        if !use_cache {
            return Ok((Vec::new(), true, Vec::new()));
        }
        let has_full = !self.inbox.outgoing.is_empty()
            || self.inbox.shutting_down
            || self.control.stall_abort
            || self.tuning.is_some();
        let cache_words = self.control.cache.words();
        let mut words = vec![0u64; 1 + cache_words + 2 * SPEC_SLOTS];
        words[0] = u64::from(!has_full);
        for &slot in self.inbox.announced.keys() {
            cache::set_bit(&mut words[1..=cache_words], slot);
        }
        let mut sum = [0f32; SPEC_VALUES];
        let spec = self.speculate(&mut sum);
        let (_, claims) = words.split_at_mut(1 + cache_words);
        for i in 0..SPEC_SLOTS {
            let v = spec.get(i).map_or(u64::MAX, |s| s.slot as u64);
            claims[i] = v;
            claims[SPEC_SLOTS + i] = !v;
        }
        self.while_waiting(|t, idle| t.agree_bits(&mut words, &mut sum, idle))?;
        let mut ready: Vec<usize> = cache::bits(&words[1..=cache_words]).collect();
        let claims = &words[1 + cache_words..];
        // Every rank claimed the same slots (at each position, the AND of the values
        // and the AND of their complements cover every bit only if all were equal), so
        // every rank packed the same tensors at the same places and the sum is theirs.
        let agreed = !spec.is_empty()
            && (0..SPEC_SLOTS).all(|i| claims[i] | claims[SPEC_SLOTS + i] == u64::MAX);
        let mut reduced = Vec::new();
        if agreed {
            ready.retain(|slot| spec.iter().all(|s| s.slot != *slot));
            for s in &spec {
                reduced.push(Response::Reduced {
                    ready: self.cached_ready(s.slot)?,
                    sum: sum[s.at..s.at + s.len].to_vec(),
                });
            }
        }
        Ok((ready, words[0] & 1 == 0, reduced))
    }

    /// Packs this rank's small ready cached f32 sums and averages (prescaled, at most
    /// [`SPEC_SLOTS`] of them, [`SPEC_VALUES`] values in all, in slot order) into
    /// `sum`, so that the cycle's agreement reduces them on the way: when every rank
    /// packed the same slots, such an op costs one round of messages instead of two.
    fn speculate(&self, sum: &mut [f32]) -> SmallVec<[Spec; SPEC_SLOTS]> {
        let mut out = SmallVec::new();
        let announced = &self.inbox.announced;
        // A cycle with many ready ops is the fusion buffer's job, not latency-bound.
        if announced.is_empty() || announced.len() > SPEC_SCAN {
            return out;
        }
        let mut slots: SmallVec<[usize; SPEC_SCAN]> = announced.keys().copied().collect();
        slots.sort_unstable();
        let mut at = 0;
        for slot in slots {
            if out.len() == SPEC_SLOTS {
                break;
            }
            let Some(req) = announced.get(&slot).and_then(|k| self.inbox.pending.get(k)) else {
                continue;
            };
            let m = &req.meta;
            let eligible = m.kind == OpKind::Allreduce
                && m.device == Device::Cpu
                && matches!(m.op, ReduceOp::Sum | ReduceOp::Average);
            let Some(t) = req
                .tensors
                .first()
                .filter(|t| eligible && t.dtype() == DType::F32)
            else {
                continue;
            };
            let n = t.len();
            if n == 0 || at + n > sum.len() {
                continue;
            }
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut sum[at..at + n]);
            dst.copy_from_slice(t.host_bytes());
            scale_bytes(dst, DType::F32, m.prescale);
            out.push(Spec { slot, at, len: n });
            at += n;
        }
        out
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
        slots
            .into_iter()
            .map(|slot| self.cached_ready(slot).map(Response::Run))
            .collect()
    }

    /// The response of cache slot `slot`, which every rank agreed on.
    fn cached_ready(&mut self, slot: usize) -> Result<negotiate::Ready> {
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
        Ok(negotiate::Ready { key, kind, metas })
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
            // Capped, so that a stall time near `Duration::MAX` cannot overflow the Instant.
            let every = (limit / 4).min(std::time::Duration::from_secs(3600));
            self.control.next_demotion_scan = now.checked_add(every).unwrap_or(now);
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
                fusion_max_tensor: crate::config::MAX_FUSED_TENSOR_BYTES,
                cache_capacity,
                autotune: false,
                hierarchical_allreduce: false,
                hierarchical_allgather: false,
                grouped_ring: None,
            };
            let control = Control::new(&Config::default(), topology, agreed);
            let inbox = Inbox::new(Arc::new(Queue::default()), topology.rank);
            Rank { control, inbox, t }
        }

        /// Submits an f32 allreduce of `shape` under `key`.
        fn submit(&mut self, key: &str, shape: &[usize]) -> Handle<Tensor> {
            let n = shape.iter().product();
            self.submit_values(key, shape, vec![0.0; n])
        }

        /// Submits an f32 allreduce of `values` with `shape` under `key`.
        fn submit_values(
            &mut self,
            key: &str,
            shape: &[usize],
            values: Vec<f32>,
        ) -> Handle<Tensor> {
            let meta =
                RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, shape, ReduceOp::Sum);
            let names: Arc<dyn PendingNames> = self.inbox.queue.clone();
            let (h, done) = handle::pair(
                smallvec::smallvec![meta.key.clone()],
                names,
                ("allreduce", self.inbox.rank),
                handle::to_tensor,
            );
            let n = values.len();
            self.inbox.accept(Command::Submit(Request {
                meta,
                tensors: smallvec::smallvec![Tensor::from_vec(values, &[n]).unwrap()],
                done,
                submitted: Instant::now(),
            }));
            h
        }

        /// One negotiation: the keys ready to run (their requests leave the inbox, as
        /// the executor would take them), with the shape agreed for each.
        /// A speculated op's key reads `<key> (summed)`.
        fn cycle(&mut self) -> Result<Vec<(String, Vec<usize>)>, Negotiation> {
            Ok(self
                .responses()?
                .into_iter()
                .map(|r| match r {
                    Response::Run(ready) => {
                        let shape = ready.first().tensors[0].shape.to_vec();
                        (ready.key.to_string(), shape)
                    }
                    Response::Reduced { ready, .. } => {
                        let shape = ready.first().tensors[0].shape.to_vec();
                        (format!("{} (summed)", ready.key), shape)
                    }
                    other => panic!("unexpected response {other:?}"),
                })
                .collect())
        }

        /// One negotiation's responses (their requests leave the inbox).
        fn responses(&mut self) -> Result<Vec<Response>, Negotiation> {
            let negotiated = self
                .control
                .negotiate(&mut self.t, &mut self.inbox, &mut None, &mut || {})
                .unwrap();
            let responses = match negotiated {
                Negotiation::Ready { responses, .. } => responses,
                left => return Err(left),
            };
            for r in &responses {
                if let Response::Run(ready) | Response::Reduced { ready, .. } = r {
                    self.inbox.pending.remove(&*ready.key);
                }
            }
            Ok(responses)
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
        // Once cached, the small f32 sum is reduced within the agreement itself.
        let summed = vec![("x (summed)".to_string(), vec![4])];
        assert_eq!(ready, &[x(4), summed.clone(), vec![], summed, x(5)]);
        // A cycle is the bit agreement, plus the full exchange when some rank has a
        // request the cache cannot name.
        assert_eq!(calls, &[2, 1, 1, 1, 2]);
    }

    #[test]
    fn small_cached_sums_are_reduced_in_the_agreement_only_when_every_rank_packed_the_same() {
        let out = two_ranks(8, |r| {
            let me = r.inbox.rank as f32;
            let values = |k: f32| vec![1.0 + me, k * (1.0 + me), 0.1 * me];
            r.submit_values("g", &[3], values(1.0));
            r.submit_values("h", &[3], values(2.0));
            r.cycle().unwrap(); // learns both in full
            r.submit_values("g", &[3], values(3.0));
            r.submit_values("h", &[3], values(4.0));
            let both = r.responses().unwrap();
            // Rank 0 has g and h ready, rank 1 only g: their packings differ, so
            // nothing is speculated; g runs as usual.
            r.submit_values("g", &[3], values(5.0));
            if r.inbox.rank == 0 {
                r.submit_values("h", &[3], values(6.0));
            }
            let differ = r.cycle().unwrap();
            (both, differ)
        });
        let sums = |rs: &[Response]| -> Vec<(String, Vec<f32>)> {
            rs.iter()
                .map(|r| match r {
                    Response::Reduced { ready, sum } => (ready.key.to_string(), sum.clone()),
                    other => panic!("expected a speculated sum, got {other:?}"),
                })
                .collect()
        };
        let rank0 = sums(&out[0].0);
        assert_eq!(rank0, sums(&out[1].0), "every rank has the same sums");
        assert_eq!(
            rank0,
            vec![
                ("g".to_string(), vec![3.0, 9.0, 0.1]),
                ("h".to_string(), vec![3.0, 12.0, 0.1])
            ]
        );
        for (_, differ) in &out {
            assert_eq!(differ, &vec![("g".to_string(), vec![3])]);
        }
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
