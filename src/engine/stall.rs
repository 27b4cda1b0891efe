//! The stall inspector: warns when some ranks have submitted a request and others
//! have not for longer than the stall check time.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::negotiate::Negotiator;
use super::request::Request;
use crate::config::Config;

/// At most this many tensor names are listed per warning.
const MAX_NAMES: usize = 8;

pub(crate) struct StallInspector {
    enabled: bool,
    after: Duration,
    shutdown_after: Duration,
    rank: usize,
    warned: HashSet<String>,
    warned_waiting: bool,
}

impl StallInspector {
    pub(crate) fn new(config: &Config, rank: usize) -> Self {
        StallInspector {
            enabled: !config.stall_check_disable,
            after: config.stall_check_time,
            shutdown_after: config.stall_shutdown_time,
            rank,
            warned: HashSet::new(),
            warned_waiting: false,
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// The stall check time.
    pub(crate) fn after(&self) -> Duration {
        self.after
    }

    /// After a cycle: warns once per request that has waited too long for some ranks,
    /// naming them.
    pub(crate) fn check(&mut self, negotiator: &Negotiator, now: Instant) {
        self.warned_waiting = false;
        if !self.enabled {
            return;
        }
        let stalled = negotiator.stalled(now, self.after);
        let live: HashSet<&str> = stalled.iter().map(|(k, _)| k.as_str()).collect();
        self.warned.retain(|k| live.contains(k.as_str()));
        let mut by_missing: Vec<(Vec<usize>, Vec<&str>)> = Vec::new();
        for (key, missing) in &stalled {
            if self.warned.contains(key) {
                continue;
            }
            match by_missing.iter_mut().find(|(m, _)| m == missing) {
                Some((_, keys)) => keys.push(key),
                None => by_missing.push((missing.clone(), vec![key])),
            }
        }
        for (missing, keys) in by_missing {
            let shown: Vec<&str> = keys.iter().take(MAX_NAMES).copied().collect();
            let more = keys.len().saturating_sub(MAX_NAMES);
            tracing::warn!(
                rank = self.rank,
                "stall: ranks {missing:?} have not submitted {shown:?}{} for more than {:?}; \
                 the other ranks are waiting for them (check that every rank submits the same names)",
                if more > 0 { format!(" and {more} more") } else { String::new() },
                self.after,
            );
            self.warned.extend(keys.iter().map(|k| k.to_string()));
        }
    }

    /// Whether a stall has lasted past the stall shutdown time (never when it is 0).
    pub(crate) fn shutdown_due(&self, negotiator: &Negotiator, now: Instant) -> bool {
        self.enabled
            && !self.shutdown_after.is_zero()
            && negotiator
                .stalled(now, self.shutdown_after)
                .iter()
                .any(|(_, missing)| !missing.is_empty())
    }

    /// While the cycle exchange itself waits (another rank's engine is not cycling):
    /// warns once per cycle with this rank's pending requests.
    pub(crate) fn check_while_waiting(
        &mut self,
        waited: Duration,
        pending: &rustc_hash::FxHashMap<super::request::Key, Box<Request>>,
    ) {
        if !self.enabled || self.warned_waiting || waited < self.after {
            return;
        }
        self.warned_waiting = true;
        let mut names: Vec<&str> = pending.keys().map(|k| &**k).collect();
        names.sort_unstable();
        names.truncate(MAX_NAMES);
        tracing::warn!(
            rank = self.rank,
            "stall: rank {} has waited {waited:?} for another rank's engine to join a negotiation cycle; \
             pending here: {names:?}",
            self.rank,
        );
    }
}
