//! The sharded optimizer over blocks it did not make: the state of fully sharded
//! units ([`FullyShard`](crate::FullyShard)), whose optimizer already holds this rank's
//! block of each parameter under the parameter's id — gathered into the whole state
//! and cut back at another rank count with the consolidation's own code.

use std::sync::Arc;

use burn::optim::ModuleOptimizer;
use kolo::Kolo;

use super::ShardedOptimizer;
use crate::error::{Error, Result};
use crate::layout::{Layout, Slot};

impl ShardedOptimizer {
    /// A sharded optimizer around `inner`, which already holds this rank's block of
    /// the state of each parameter of `slots` (whole shapes, agreed by every rank),
    /// keyed by the parameter's id: the state of [`FullyShard`](crate::FullyShard)
    /// units, which [`consolidate_blocks`](Self::consolidate_blocks) gathers.
    pub(crate) fn over_blocks(
        kolo: &Kolo,
        inner: ModuleOptimizer,
        slots: Vec<Slot>,
    ) -> Result<Self> {
        let mut s = Self::new(kolo, inner);
        let layout = Layout::given(slots, &s.prefix)?;
        s.plan = Some(Arc::new(s.plan_of(layout)?));
        Ok(s)
    }

    /// [`consolidate`](Self::consolidate) of the blocks of
    /// [`over_blocks`](Self::over_blocks).
    pub(crate) fn consolidate_blocks(&mut self) -> Result<ModuleOptimizer> {
        let plan = self.plan.clone().ok_or_else(|| Error::InvalidArgument {
            what: "ShardedOptimizer::consolidate",
            message: "no parameters".into(),
        })?;
        self.consolidate_plan(&plan)
    }

    /// This rank's blocks of `full`, the whole state of the parameters of
    /// [`over_blocks`](Self::over_blocks): the optimizer for units at this rank count.
    pub(crate) fn load_blocks(mut self, full: &ModuleOptimizer) -> Result<ModuleOptimizer> {
        let plan = self.plan.clone().ok_or_else(|| Error::InvalidArgument {
            what: "ShardedOptimizer::load_consolidated",
            message: "no parameters".into(),
        })?;
        self.load_with(&plan, full)?;
        Ok(self.inner)
    }
}
