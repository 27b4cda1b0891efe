//! This rank's inbox: the commands taken from the queue, the requests pending by
//! negotiation key, and which of them go out in full or by cache slot next cycle.

use rustc_hash::FxHashMap;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Duration;

use super::queue::Queue;
use super::request::{Command, Key, RequestMeta};
use super::respond;
use crate::error::{Error, Result};

/// This rank's queue: requests accepted from framework threads and not yet finished.
pub(super) struct Inbox {
    pub(super) queue: Arc<Queue>,
    /// The commands last taken from the queue (a buffer swapped with the queue's).
    pub(super) taken: Vec<Command>,
    /// Requests by negotiation key, waiting to be negotiated or run.
    pub(super) pending: respond::Pending,
    /// Keys of the requests to announce in full in the next cycle (their requests are
    /// in `pending`; copied only if they really go out in full).
    pub(super) outgoing: Vec<Key>,
    /// Requests announced by their response-cache slot: slot → key.
    pub(super) announced: FxHashMap<usize, Key>,
    pub(super) shutting_down: bool,
    pub(super) rank: usize,
    /// Timeline start (Some path) / stop (None) requests, with where to answer.
    pub(super) timeline_requests: Vec<(Option<std::path::PathBuf>, SyncSender<Result<()>>)>,
    /// A request on a device was taken in: from then on only the engine thread runs
    /// cycles (CUDA and NCCL calls stay on it; see `driver.rs`).
    pub(super) saw_device: bool,
    /// Sends and receives taken in, for the point-to-point lane (`p2p.rs`): they are
    /// not negotiated.
    pub(super) p2p: Vec<super::request::Request>,
}

impl Inbox {
    pub(super) fn new(queue: Arc<Queue>, rank: usize) -> Self {
        Inbox {
            queue,
            taken: Vec::new(),
            pending: FxHashMap::default(),
            outgoing: Vec::new(),
            announced: FxHashMap::default(),
            shutting_down: false,
            rank,
            timeline_requests: Vec::new(),
            saw_device: false,
            p2p: Vec::new(),
        }
    }

    pub(super) fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req) => {
                if self.shutting_down {
                    let err = stopped(&req.meta, self.rank, "this rank is shutting down");
                    req.fail(err);
                    return;
                }
                if req.meta.kind.is_p2p() {
                    self.p2p.push(*req);
                    return;
                }
                if req.meta.device != super::request::Device::Cpu {
                    self.saw_device = true;
                }
                self.outgoing.push(req.meta.key.clone());
                self.pending.insert(req.meta.key.clone(), req);
            }
            Command::Shutdown => self.shutting_down = true,
            Command::Timeline { path, reply } => self.timeline_requests.push((path, reply)),
        }
    }

    /// Takes every command already queued, without blocking.
    pub(super) fn drain(&mut self) {
        self.take(Some(Duration::ZERO));
    }

    /// Waits up to `timeout` for a command, then takes every queued one.
    pub(super) fn wait_for_work(&mut self, timeout: Duration) {
        self.take(Some(timeout));
    }

    pub(super) fn take(&mut self, timeout: Option<Duration>) {
        let mut taken = std::mem::take(&mut self.taken);
        self.queue.take(&mut taken, timeout);
        for cmd in taken.drain(..) {
            self.accept(cmd);
        }
        self.taken = taken;
    }

    /// Takes the request announced by cache `slot` (if any) back into the next cycle's
    /// full announcements.
    pub(super) fn announce_in_full(&mut self, slot: usize) {
        if let Some(key) = self.announced.remove(&slot) {
            if self.pending.contains_key(&key) {
                self.outgoing.push(key);
            }
        }
    }

    /// Without the cache (disabled, or a rank has joined) every pending request is
    /// announced in full.
    pub(super) fn unannounce_all(&mut self) {
        let slots: Vec<usize> = self.announced.keys().copied().collect();
        for slot in slots {
            self.announce_in_full(slot);
        }
    }

    pub(super) fn has_work(&self) -> bool {
        !self.pending.is_empty() || !self.outgoing.is_empty()
    }

    pub(super) fn fail_all(&mut self, error: impl Fn(&RequestMeta) -> Error) {
        self.outgoing.clear();
        self.announced.clear();
        for (_, req) in self.pending.drain() {
            let err = error(&req.meta);
            req.fail(err);
        }
    }
}

/// The error for a request that the engine will not run because `reason`.
pub(super) fn stopped(meta: &RequestMeta, rank: usize, reason: &str) -> Error {
    Error::engine_stopped(meta.kind.name(), &*meta.key, rank, reason)
}
