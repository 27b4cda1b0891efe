//! The negotiation step of a cycle: from this rank's inbox, the response cache, the
//! negotiator and the stall inspector to the responses every rank runs, in the same
//! order everywhere (the protocol is in `README.md`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use smallvec::SmallVec;

use super::agree::Agreed;
use super::cache::{self, ResponseCache};
use super::layout::scale_bytes;
use super::negotiate::Negotiator;
use super::negotiate::{self, Outcome, Response};
use super::request::Settings;
use super::request::{CycleMsg, Device, OpKind};
use super::stall::StallInspector;
use super::Inbox;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::transport::{Idle, Topology, Transport};
use crate::vocab::ReduceOp;

/// What negotiation keeps between cycles, beyond the inbox: what every rank has
/// asked for, the response cache, the settings every rank agreed on, and the stall
/// inspector.
pub(super) struct Control {
    pub(super) negotiator: Negotiator,
    pub(super) cache: ResponseCache,
    pub(super) agreed: Agreed,
    pub(super) stall: StallInspector,
    /// Tell the other ranks in the next cycle that the stall shutdown time has passed.
    pub(super) stall_abort: bool,
    /// When `announce_cached` next looks for requests waiting long enough to be
    /// announced in full.
    pub(super) next_demotion_scan: Instant,
    /// The last cycle made a response ready or carried a new request.
    pub(super) last_cycle_had_news: bool,
}

impl Control {
    pub(super) fn new(config: &Config, topology: Topology, agreed: Agreed) -> Self {
        Control {
            negotiator: Negotiator::new(topology.size),
            cache: ResponseCache::new(agreed.cache_capacity),
            stall: StallInspector::new(config, topology.rank),
            stall_abort: false,
            next_demotion_scan: Instant::now(),
            last_cycle_had_news: false,
            agreed,
        }
    }

    /// Takes the tuner's fusion threshold and cache setting (`capacity` slots when
    /// the cache is on). Switching the cache empties it: requests announced by a slot
    /// go out in full in the next cycle.
    pub(super) fn apply(&mut self, s: &Settings, capacity: usize, inbox: &mut Inbox) {
        self.agreed.fusion_threshold = s.fusion_threshold;
        self.agreed.fusion_max_tensor = s.fusion_max_tensor;
        if s.cache != self.cache.enabled() {
            inbox.unannounce_all();
            self.cache = ResponseCache::new(if s.cache { capacity } else { 0 });
        }
    }
}

/// What a cycle's negotiation decided.
#[derive(Debug)]
pub(super) enum Negotiation {
    /// A rank left: nothing runs, and this engine stops communicating.
    RankLeft(usize),
    /// The responses to run, and settings the tuner made every rank switch to.
    Ready {
        responses: Vec<Response>,
        tuning: Option<Settings>,
        /// When the agreement ended (the responses' negotiation spans end here).
        at: Instant,
    },
}

/// Most ops reduced speculatively in one cycle's agreement.
const SPEC_SLOTS: usize = 4;
/// f32 values the agreement carries for them (512 bytes per message).
pub(super) const SPEC_VALUES: usize = 128;
/// Speculation is tried only when at most this many cached ops are ready.
const SPEC_SCAN: usize = 16;

/// Cache slots agreed in a cycle: inline for a few, as a latency-bound cycle has.
type Slots = SmallVec<[usize; 8]>;

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
    /// for other ranks (the GPU plane completes its ops there) and returns the longest
    /// the engine may nap before it runs again (see `Waiting`).
    pub(super) fn negotiate(
        &mut self,
        t: &mut dyn Transport,
        inbox: &mut Inbox,
        tuning: &mut Option<Settings>,
        poll: &mut dyn FnMut(&mut Inbox) -> Duration,
        started: Instant,
    ) -> Result<Negotiation> {
        Negotiate {
            t,
            inbox,
            control: self,
            tuning,
            poll,
            started,
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
    poll: &'a mut dyn FnMut(&mut Inbox) -> Duration,
    /// When the cycle started (one clock read per cycle serves its bookkeeping).
    started: Instant,
}

/// The engine while its transport waits for other ranks in a control-plane call.
struct Waiting<'a> {
    inbox: &'a mut Inbox,
    poll: &'a mut dyn FnMut(&mut Inbox) -> Duration,
    stall: &'a mut StallInspector,
    /// What the last `poll` asked for: the longest nap before the next look.
    poll_within: Duration,
}

impl Idle for Waiting<'_> {
    fn poll(&mut self, waited: Duration) {
        self.inbox.drain();
        self.poll_within = (self.poll)(self.inbox);
        self.stall.check_while_waiting(waited, &self.inbox.pending);
    }

    /// On the engine's queue, so that a submit or a kick (a caller's send or receive)
    /// ends the nap at once, and no longer than `poll` asked while sends or receives
    /// wait. With `thread::sleep` (1 ms, deaf to submits) a pair's round trip took
    /// 3.5 ms while this rank waited for a stopped one.
    fn nap(&mut self, d: Duration) {
        self.inbox.queue.wait_for_command(d.min(self.poll_within));
    }
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
        for slot in cached_ready {
            responses.push(Response::Run(self.cached_ready(slot)?));
        }
        let mut stale = Vec::new();
        if !msgs.is_empty() {
            // A full request under a cached name means its request changed (or it was
            // demoted by the stall inspector): forget the slot everywhere.
            for m in distinct(&msgs) {
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
            at: now,
        })
    }

    /// Phase 1 (with the cache): one AND of `[flags, cache bits, speculated slots]`
    /// across ranks, which also sums the small ops this rank speculates on. Returns
    /// the cache slots ready on every rank, whether any rank has something the cache
    /// cannot say (then the full exchange follows), and the ops already reduced.
    fn exchange_bits(&mut self, use_cache: bool) -> Result<(Slots, bool, Vec<Response>)> {
        if !use_cache {
            return Ok((Slots::new(), true, Vec::new()));
        }
        let has_full = !self.inbox.outgoing.is_empty()
            || self.inbox.shutting_down
            || self.control.stall_abort
            || self.tuning.is_some();
        let cache_words = self.control.cache.words();
        // On the stack for the default cache capacity: a small op's cycle allocates
        // as little as it can.
        let mut words: SmallVec<[u64; 64]> =
            smallvec::smallvec![0u64; 1 + cache_words + 2 * SPEC_SLOTS];
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
        let mut ready: Slots = cache::bits(&words[1..=cache_words]).collect();
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
                    sum: SmallVec::from_slice(&sum[s.at..s.at + s.len]),
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
    fn exchange_full(&mut self) -> Result<Vec<Arc<CycleMsg>>> {
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
        // In place: the list keeps its memory from cycle to cycle.
        let inbox = &mut *self.inbox;
        let cache = &self.control.cache;
        inbox.outgoing.retain(|key| {
            let slot = inbox.pending.get(key).and_then(|r| {
                ResponseCache::cacheable(r.meta.kind)
                    .then(|| cache.lookup(&r.meta, inbox.rank))
                    .flatten()
            });
            if let Some(slot) = slot {
                inbox.announced.insert(slot, key.clone());
            }
            slot.is_none()
        });
        // Looking at every bit-announced request's age is not free with thousands of
        // them: do it a few times per stall interval, not every cycle.
        let now = self.started;
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
        call: impl FnOnce(&mut dyn Transport, &mut dyn Idle) -> Result<R>,
    ) -> Result<R> {
        let Negotiate {
            t,
            inbox,
            control: Control { stall, .. },
            poll,
            ..
        } = self;
        call(
            &mut **t,
            &mut Waiting {
                inbox,
                poll: &mut **poll,
                stall,
                poll_within: Duration::MAX,
            },
        )
    }

    /// Every rank's [`CycleMsg`], in rank order. Ranks that sent the same bytes get
    /// the same decoded message (one `Arc`): in a data-parallel job most ranks announce
    /// the same requests, and at thousands of ranks decoding each copy was most of
    /// the first step (simulated: 0.66 s of ResNet-50's at 4096 ranks).
    fn full_exchange(&mut self, msg: &CycleMsg) -> Result<Vec<Arc<CycleMsg>>> {
        let bytes = postcard::to_stdvec(msg)
            .map_err(|e| Error::Internal(format!("encoding a cycle message: {e}")))?;
        let all = self.while_waiting(|t, idle| t.exchange(&bytes, idle))?;
        let mut decoded: FxHashMap<&[u8], Arc<CycleMsg>> = FxHashMap::default();
        let mut out = Vec::with_capacity(all.len());
        for (r, b) in all.iter().enumerate() {
            if let Some(m) = decoded.get(b.as_slice()) {
                out.push(m.clone());
                continue;
            }
            let m =
                Arc::new(postcard::from_bytes::<CycleMsg>(b).map_err(|e| {
                    Error::Internal(format!("decoding rank {r}'s cycle message: {e}"))
                })?);
            decoded.insert(b, m.clone());
            out.push(m);
        }
        Ok(out)
    }
}

/// Each message once where consecutive ranks share one.
fn distinct(msgs: &[Arc<CycleMsg>]) -> impl Iterator<Item = &CycleMsg> {
    msgs.iter()
        .enumerate()
        .filter(|(r, m)| *r == 0 || !Arc::ptr_eq(m, &msgs[r - 1]))
        .map(|(_, m)| &**m)
}

#[cfg(test)]
mod tests;
