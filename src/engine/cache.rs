//! The response cache: requests that ran before, by slot, identical on every rank.
//!
//! Steady-state training submits the same names with the same shapes every step.
//! Once such a request has been negotiated and run, every rank caches it in the same
//! slot (every rank processes the same responses in the same order, so the caches stay
//! identical). From then on a rank announces it by setting the slot's bit, and a cycle
//! in which no rank has anything else to say is one bitwise-AND allreduce of the bit
//! vectors: the bits set everywhere are ready, in slot order.
//!
//! A request for a cached name with a different shape, dtype or op is sent in full,
//! which invalidates the slot on every rank (the same message reaches all of them).
//! When the cache is full the least recently used slot is evicted; any request still
//! announced by an invalidated or evicted slot is re-sent in full.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use super::request::{OpKind, RequestMeta};

#[derive(Debug)]
struct Slot {
    meta: Arc<RequestMeta>,
    last_used: u64,
}

/// The cache; see the module docs.
#[derive(Debug)]
pub(crate) struct ResponseCache {
    capacity: usize,
    slots: Vec<Option<Slot>>,
    by_key: FxHashMap<String, usize>,
    clock: u64,
    evictions_logged: bool,
}

impl ResponseCache {
    pub(crate) fn new(capacity: usize) -> Self {
        ResponseCache {
            capacity,
            slots: Vec::new(),
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

    /// Whether requests of this kind can be cached: those whose request is the same on
    /// every rank (allgather and alltoall differ per rank in dim 0 or splits).
    pub(crate) fn cacheable(kind: OpKind) -> bool {
        matches!(
            kind,
            OpKind::Allreduce
                | OpKind::GroupedAllreduce
                | OpKind::Broadcast
                | OpKind::Reducescatter
        )
    }

    /// The slot of an identical cached request.
    pub(crate) fn lookup(&self, meta: &RequestMeta) -> Option<usize> {
        let slot = *self.by_key.get(&meta.key)?;
        let cached = self.slots.get(slot)?.as_ref()?;
        (*cached.meta == *meta).then_some(slot)
    }

    /// The slot cached under `key`, whatever its request.
    #[cfg(test)]
    pub(crate) fn slot_of(&self, key: &str) -> Option<usize> {
        self.by_key.get(key).copied()
    }

    pub(crate) fn meta(&self, slot: usize) -> Option<&Arc<RequestMeta>> {
        self.slots.get(slot)?.as_ref().map(|s| &s.meta)
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
        }
        Some(slot)
    }

    /// Caches a request that just ran; returns the slot that was evicted for it, if any.
    pub(crate) fn insert(&mut self, meta: Arc<RequestMeta>) -> Option<usize> {
        if !self.enabled() || self.by_key.contains_key(&meta.key) {
            return None;
        }
        self.clock += 1;
        let (slot, evicted) = if let Some(free) = self.slots.iter().position(Option::is_none) {
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
                self.by_key.remove(&old.meta.key);
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
        self.by_key.insert(meta.key.clone(), slot);
        self.slots[slot] = Some(Slot {
            meta,
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
    words.iter().enumerate().flat_map(|(i, &w)| {
        (0..64)
            .filter(move |b| w & (1 << b) != 0)
            .map(move |b| i * 64 + b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::ReduceOp;
    use crate::tensor::DType;

    fn meta(key: &str, len: usize) -> RequestMeta {
        RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, &[len], ReduceOp::Sum)
    }

    #[test]
    fn hits_only_identical_requests() {
        let mut c = ResponseCache::new(4);
        assert_eq!(c.insert(Arc::new(meta("a", 3))), None);
        assert_eq!(c.lookup(&meta("a", 3)), Some(0));
        assert_eq!(c.lookup(&meta("a", 4)), None);
        assert_eq!(c.slot_of("a"), Some(0));
        assert_eq!(c.invalidate("a"), Some(0));
        assert_eq!(c.lookup(&meta("a", 3)), None);
        assert_eq!(c.insert(Arc::new(meta("b", 1))), None);
        assert_eq!(c.slot_of("b"), Some(0), "freed slots are reused");
    }

    #[test]
    fn evicts_the_least_recently_used() {
        let mut c = ResponseCache::new(2);
        c.insert(Arc::new(meta("a", 1)));
        c.insert(Arc::new(meta("b", 1)));
        c.touch(0);
        assert_eq!(c.insert(Arc::new(meta("c", 1))), Some(1));
        assert_eq!(c.lookup(&meta("b", 1)), None);
        assert_eq!(c.lookup(&meta("c", 1)), Some(1));
        assert_eq!(c.lookup(&meta("a", 1)), Some(0));
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let mut c = ResponseCache::new(0);
        assert_eq!(c.insert(Arc::new(meta("a", 1))), None);
        assert_eq!(c.lookup(&meta("a", 1)), None);
        assert_eq!(c.words(), 0);
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
