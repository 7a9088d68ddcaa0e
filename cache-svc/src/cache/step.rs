//! `Step`: one holder call that releases, completes a step and extends, in
//! that order, under one hold of the cache.
//!
//! The order is the protocol's, not the transport's: a decode step's extends
//! are granted from the blocks that the same call's releases and completion
//! gave back, so a full pool still grows its running sequences. Every part is
//! checked before any is applied: a call with a malformed part changes
//! nothing.

use std::time::Instant;

use super::{Batch, Cache};
use crate::error::Result;
use crate::ids::{Epoch, SeqId, SessionId, Step};
use crate::lease::{ExtendItem, Outcome, ReleaseMode, ReleaseResult};

/// The release part of a `Step`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepRelease {
    /// The sequences to give back.
    pub seq_ids: Vec<SeqId>,
    /// Fenced or not, after a failed pass or not.
    pub mode: ReleaseMode,
}

/// The extend part of a `Step`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepExtend {
    /// The extends' step and atomicity.
    pub batch: Batch,
    /// The sequences that grow or report progress.
    pub items: Vec<ExtendItem>,
}

/// What one `Step` call asks; a part left out is not applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepParts {
    /// Applied first.
    pub release: Option<StepRelease>,
    /// The step the holder's forward pass completed; applied second.
    pub complete: Option<Step>,
    /// Applied last, from what the first two gave back.
    pub extend: Option<StepExtend>,
}

/// The answer of each part a `Step` call carried (`None` for a part it did
/// not carry).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutcome {
    /// One result per released sequence, in order.
    pub released: Option<Vec<ReleaseResult>>,
    /// The blocks that left the fenced state at the completion.
    pub returned: Option<u64>,
    /// One outcome per extend item, in order.
    pub extended: Option<Vec<Outcome>>,
}

impl Cache {
    /// Applies a holder's `Step`: checks every part (the session, its epoch,
    /// the extends' figures against the lengths before anything changes),
    /// then releases, completes the step and extends, in that order.
    pub fn step(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        parts: &StepParts,
        now: Instant,
    ) -> Result<StepOutcome> {
        self.touch(session_id, epoch, now)?;
        // a release in this call only makes an item unknown, which the
        // extend answers per sequence
        if let Some(extend) = &parts.extend {
            self.check_extend_items(session_id, &extend.items)?;
        }
        let released = match &parts.release {
            Some(part) => {
                Some(self.release_with(session_id, epoch, &part.seq_ids, part.mode, now)?)
            }
            None => None,
        };
        let returned = match parts.complete {
            Some(step) => Some(self.complete_step(session_id, epoch, step, now)?),
            None => None,
        };
        let extended = match &parts.extend {
            Some(part) => {
                Some(self.extend_items(session_id, epoch, part.batch, &part.items, now)?)
            }
            None => None,
        };
        Ok(StepOutcome {
            released,
            returned,
            extended,
        })
    }
}
