//! The response cache: requests that ran before, by slot, identical on every rank.
//!
//! Steady-state training submits the same names with the same shapes every step.
//! Once such a request has been negotiated and run, every rank caches it in the same
//! slot (every rank processes the same responses in the same order, so the caches stay
//! identical). From then on a rank announces it by setting the slot's bit, and a cycle
//! in which no rank has anything else to say is one bitwise-AND allreduce of the bit
//! vectors: the bits set everywhere are ready, in slot order.
//!
//! A slot holds every rank's request, so ops whose requests differ per rank (allgather's
//! dim 0, alltoall's splits) are cached too: a rank announces a slot only when its own
//! request equals the one it sent last time, so a slot set on every rank means every
//! rank's request is unchanged.
//!
//! A request for a cached name with a different shape, dtype or op is sent in full,
//! which invalidates the slot on every rank (the same message reaches all of them).
//! When the cache is full the least recently used slot is evicted; any request still
//! announced by an invalidated or evicted slot is re-sent in full.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use super::negotiate::Metas;
use super::request::{Key, OpKind, RequestMeta};

#[derive(Debug)]
struct Slot {
    /// Every rank's request, as the response had them.
    metas: Metas,
    last_used: u64,
}

/// The negotiation key of a response's requests.
fn key_of(metas: &[Option<Arc<RequestMeta>>]) -> Option<&Key> {
    metas.iter().flatten().next().map(|m| &m.key)
}

/// The cache; see the module docs.
#[derive(Debug)]
pub(crate) struct ResponseCache {
    capacity: usize,
    slots: Vec<Option<Slot>>,
    /// Slots emptied by invalidation, reused before the cache grows (the same on every
    /// rank, since every rank invalidates the same keys in the same order).
    free: Vec<usize>,
    by_key: FxHashMap<Key, usize>,
    clock: u64,
    evictions_logged: bool,
}

impl ResponseCache {
    pub(crate) fn new(capacity: usize) -> Self {
        ResponseCache {
            capacity,
            slots: Vec::new(),
            free: Vec::new(),
            by_key: FxHashMap::default(),
            clock: 0,
            evictions_logged: false,
        }
    }

    /// Number of 64-bit words of the bit vector.
    pub(crate) fn words(&self) -> usize {
        self.capacity.div_ceil(64)
    }

    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Whether requests of this kind can be cached: every op on tensors (join and
    /// barrier are not per-name work).
    pub(crate) fn cacheable(kind: OpKind) -> bool {
        matches!(
            kind,
            OpKind::Allreduce
                | OpKind::GroupedAllreduce
                | OpKind::Broadcast
                | OpKind::Reducescatter
                | OpKind::Allgather
                | OpKind::Alltoall
                | OpKind::GroupedAllgather
                | OpKind::GroupedReducescatter
        )
    }

    /// The slot whose request from `rank` is identical to `meta`.
    pub(crate) fn lookup(&self, meta: &RequestMeta, rank: usize) -> Option<usize> {
        let slot = *self.by_key.get(&*meta.key)?;
        let cached = self.slots.get(slot)?.as_ref()?;
        let mine = cached.metas.get(rank)?.as_deref()?;
        (*mine == *meta).then_some(slot)
    }

    /// The slot cached under `key`, whatever its request.
    #[cfg(test)]
    pub(crate) fn slot_of(&self, key: &str) -> Option<usize> {
        self.by_key.get(key).copied()
    }

    /// Every rank's request cached in `slot`.
    pub(crate) fn metas(&self, slot: usize) -> Option<&Metas> {
        self.slots.get(slot)?.as_ref().map(|s| &s.metas)
    }

    /// Marks a slot as used by this cycle.
    pub(crate) fn touch(&mut self, slot: usize) {
        self.clock += 1;
        if let Some(Some(s)) = self.slots.get_mut(slot) {
            s.last_used = self.clock;
        }
    }

    /// Forgets `key`; returns the slot it had.
    pub(crate) fn invalidate(&mut self, key: &str) -> Option<usize> {
        let slot = self.by_key.remove(key)?;
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
            self.free.push(slot);
        }
        Some(slot)
    }

    /// Caches a response that just ran (every rank's request); returns the slot that
    /// was evicted for it, if any.
    pub(crate) fn insert(&mut self, metas: Metas) -> Option<usize> {
        let key = key_of(&metas)?.clone();
        if !self.enabled() || self.by_key.contains_key(&*key) {
            return None;
        }
        self.clock += 1;
        let (slot, evicted) = if let Some(free) = self.free.pop() {
            (free, None)
        } else if self.slots.len() < self.capacity {
            self.slots.push(None);
            (self.slots.len() - 1, None)
        } else {
            let lru = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().map(|s| (s.last_used, i)))
                .min()
                .map_or(0, |(_, i)| i);
            if let Some(old) = self.slots[lru].take() {
                if let Some(k) = key_of(&old.metas) {
                    self.by_key.remove(&**k);
                }
                if !self.evictions_logged {
                    self.evictions_logged = true;
                    tracing::warn!(
                        capacity = self.capacity,
                        "response cache full: evicting least recently used entries (logged once); \
                         raise KOLO_CACHE_CAPACITY above the number of tensors per step"
                    );
                }
            }
            (lru, Some(lru))
        };
        self.by_key.insert(key, slot);
        self.slots[slot] = Some(Slot {
            metas,
            last_used: self.clock,
        });
        evicted
    }
}

/// Sets bit `slot` of a bit vector.
pub(crate) fn set_bit(words: &mut [u64], slot: usize) {
    if let Some(w) = words.get_mut(slot / 64) {
        *w |= 1 << (slot % 64);
    }
}

/// The set bits of a bit vector, in increasing order.
pub(crate) fn bits(words: &[u64]) -> impl Iterator<Item = usize> + '_ {
    // Every cycle scans the whole vector (16 words at the default capacity): step from
    // set bit to set bit rather than testing all 64 of each word.
    words.iter().enumerate().flat_map(|(i, &w)| {
        let mut rest = w;
        std::iter::from_fn(move || {
            (rest != 0).then(|| {
                let b = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                i * 64 + b
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use crate::vocab::ReduceOp;

    fn meta(key: &str, len: usize) -> RequestMeta {
        RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, &[len], ReduceOp::Sum)
    }

    /// One rank's response of `meta`.
    fn one(m: RequestMeta) -> Metas {
        Arc::from([Some(Arc::new(m))])
    }

    #[test]
    fn hits_only_identical_requests() {
        let mut c = ResponseCache::new(4);
        assert_eq!(c.insert(one(meta("a", 3))), None);
        assert_eq!(c.lookup(&meta("a", 3), 0), Some(0));
        assert_eq!(c.lookup(&meta("a", 4), 0), None);
        assert_eq!(c.slot_of("a"), Some(0));
        assert_eq!(c.invalidate("a"), Some(0));
        assert_eq!(c.lookup(&meta("a", 3), 0), None);
        assert_eq!(c.insert(one(meta("b", 1))), None);
        assert_eq!(c.slot_of("b"), Some(0), "freed slots are reused");
    }

    #[test]
    fn evicts_the_least_recently_used() {
        let mut c = ResponseCache::new(2);
        c.insert(one(meta("a", 1)));
        c.insert(one(meta("b", 1)));
        c.touch(0);
        assert_eq!(c.insert(one(meta("c", 1))), Some(1));
        assert_eq!(c.lookup(&meta("b", 1), 0), None);
        assert_eq!(c.lookup(&meta("c", 1), 0), Some(1));
        assert_eq!(c.lookup(&meta("a", 1), 0), Some(0));
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let mut c = ResponseCache::new(0);
        assert_eq!(c.insert(one(meta("a", 1))), None);
        assert_eq!(c.lookup(&meta("a", 1), 0), None);
        assert_eq!(c.words(), 0);
    }

    #[test]
    fn per_rank_requests_hit_only_for_their_own_rank() {
        let g = |rows: usize| {
            RequestMeta::for_test(
                "g",
                OpKind::Allgather,
                DType::F32,
                &[rows, 2],
                ReduceOp::Sum,
            )
        };
        let mut c = ResponseCache::new(4);
        c.insert(Arc::from([Some(Arc::new(g(1))), Some(Arc::new(g(3)))]));
        assert_eq!(c.lookup(&g(1), 0), Some(0));
        assert_eq!(c.lookup(&g(3), 1), Some(0));
        assert_eq!(c.lookup(&g(3), 0), None, "rank 0 sent 1 row last time");
        assert_eq!(c.metas(0).map(|m| m.len()), Some(2));
    }

    #[test]
    fn bit_vectors() {
        let mut w = vec![0u64; 2];
        set_bit(&mut w, 3);
        set_bit(&mut w, 64);
        set_bit(&mut w, 127);
        assert_eq!(bits(&w).collect::<Vec<_>>(), vec![3, 64, 127]);
    }
}
