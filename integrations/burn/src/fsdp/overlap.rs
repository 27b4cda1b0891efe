//! Overlap of a unit's communication with the other units' computation in backward
//! (FSDP's backward prefetch; its reduce-scatters going out as backward produces
//! them).
//!
//! Each use of a unit in a forward pass leaves a [`Link`]. When the next use's input
//! *is* this use's output (units fed straight into each other: a transformer's
//! blocks, or layers with their activation inside the unit's closure), this use's
//! backward is certain to run in every backward pass that runs the next one's, and
//! after it (its op is the next one's parent). Then the next use's backward
//! - first submits this use's all-gather, which the engine runs while the next use
//!   recomputes its forward and backward (prefetch), and
//! - submits its own reduce-scatter without waiting: this use's backward waits for
//!   it and registers its blocks' gradients, after submitting its own.
//!
//! A use whose input is anything else gathers and waits for itself, so nothing is
//! left undelivered when the backward pass ends, whatever the graph.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use burn::backend::autodiff::NodeId;
use burn::tensor::Tensor;

use super::ahead::Prefetch;
pub(super) use super::Pending;
use crate::error::Result;

/// Turns a finished reduce-scatter into this rank's blocks' gradients.
pub(super) type Finish = Box<dyn FnOnce(Vec<kolo::Tensor>) -> Result<Vec<Tensor<1>>> + Send>;

/// Submits a use's all-gather of its blocks (as they were in its forward).
pub(super) type Start = Box<dyn Fn() -> Result<Pending> + Send>;

/// A reduce-scatter whose blocks' gradients a later backward step registers.
pub(super) struct Deferred {
    /// The unit's name, for messages.
    pub(super) name: String,
    pub(super) handle: Pending,
    pub(super) finish: Finish,
    /// The blocks' autodiff nodes.
    pub(super) targets: Arc<Vec<NodeId>>,
}

impl Deferred {
    /// Waits for the reduce-scatter: the nodes and their gradients.
    pub(super) fn wait(self) -> Result<(Arc<Vec<NodeId>>, Vec<Tensor<1>>)> {
        let parts = self.handle.wait()?;
        Ok((self.targets, (self.finish)(parts)?))
    }
}

/// One use of a unit in a forward pass, as the backward pass sees it.
pub(super) struct Link {
    /// The unit used.
    unit: Arc<dyn Prefetch>,
    state: Mutex<State>,
}

/// What a [`Link`] holds between its use's forward and backward.
struct State {
    /// Submits the use's all-gather (`None`: the use keeps its gathered parameters).
    start: Option<Start>,
    /// The all-gather a later use's backward submitted for this one.
    prefetched: Option<Result<Pending>>,
    /// Reduce-scatters of later uses, registered by this use's backward.
    deferred: Vec<Deferred>,
    /// Whether this use's backward has begun (nothing is prefetched or deferred to
    /// it after that).
    begun: bool,
}

thread_local! {
    /// The last use made on this thread and its output node.
    static LAST: RefCell<Option<(Weak<Link>, NodeId)>> = const { RefCell::new(None) };
}

impl Link {
    /// A use of `unit` that gathers with `start` in backward (`None`: it keeps its
    /// parameters).
    pub(super) fn new(unit: Arc<dyn Prefetch>, start: Option<Start>) -> Arc<Link> {
        Arc::new(Link {
            unit,
            state: Mutex::new(State {
                start,
                prefetched: None,
                deferred: Vec::new(),
                begun: false,
            }),
        })
    }

    /// The last use made on this thread when its output is node `input` (and its
    /// backward has not begun).
    pub(super) fn previous(input: NodeId) -> Option<Arc<Link>> {
        LAST.with(|last| {
            let last = last.borrow();
            let (link, output) = last.as_ref()?;
            let link = link.upgrade().filter(|_| *output == input)?;
            let begun = link.state().begun;
            (!begun).then_some(link)
        })
    }

    /// The unit of the last use made on this thread, if that use's backward has not
    /// begun (it is of the same step).
    pub(super) fn last_unit() -> Option<Arc<dyn Prefetch>> {
        LAST.with(|last| {
            let last = last.borrow();
            let link = last.as_ref()?.0.upgrade()?;
            let begun = link.state().begun;
            (!begun).then(|| Arc::clone(&link.unit))
        })
    }

    /// Makes `link`, whose output is node `output`, the last use made on this thread.
    pub(super) fn made(link: &Arc<Link>, output: NodeId) {
        LAST.with(|last| *last.borrow_mut() = Some((Arc::downgrade(link), output)));
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Submits this use's all-gather ahead of its backward (once; not when it keeps
    /// its parameters or its backward has begun).
    pub(super) fn prefetch(&self) {
        let mut state = self.state();
        if state.begun || state.prefetched.is_some() {
            return;
        }
        if let Some(start) = &state.start {
            let handle = start();
            state.prefetched = Some(handle);
        }
    }

    /// Marks the backward begun and takes the prefetched all-gather, if any.
    pub(super) fn begin(&self) -> Option<Result<Pending>> {
        let mut state = self.state();
        state.begun = true;
        state.start = None;
        state.prefetched.take()
    }

    /// Hands a reduce-scatter to this use's backward; gives it back when that
    /// backward has already begun (the caller then waits for it itself).
    pub(super) fn defer(&self, d: Deferred) -> Option<Deferred> {
        let mut state = self.state();
        if state.begun {
            return Some(d);
        }
        state.deferred.push(d);
        None
    }

    /// The reduce-scatters handed to this use.
    pub(super) fn take_deferred(&self) -> Vec<Deferred> {
        std::mem::take(&mut self.state().deferred)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if !state.deferred.is_empty() && !std::thread::panicking() {
            // Cannot happen when the ancestry test holds; never lose gradients quietly.
            panic!(
                "kolo_burn::FullyShard {}: its gradients were handed to an earlier unit \
                 whose backward never ran, so they were not delivered",
                state.deferred[0].name
            );
        }
    }
}
