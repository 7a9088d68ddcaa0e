//! `Cache::step`'s order, one test per rule: release before completion,
//! completion before extend, release before extend, and every part checked
//! before any is applied.

use super::{Fixture, spec};
use crate::cache::{Batch, StepExtend, StepOutcome, StepParts, StepRelease};
use crate::error::{Error, Result};
use crate::ids::{SeqId, Step};
use crate::lease::{ExtendItem, Growth, Prompt, RejectReason, ReleaseMode, ReleaseStatus};

impl Fixture {
    fn step(&mut self, parts: &StepParts) -> Result<StepOutcome> {
        let out = self.cache.step(self.session, self.epoch, parts, self.now);
        self.check();
        out
    }
}

fn release(seq_ids: &[u64], fence_step: Option<u64>) -> StepRelease {
    StepRelease {
        seq_ids: seq_ids.iter().copied().map(SeqId).collect(),
        mode: ReleaseMode::from(fence_step.map(Step)),
    }
}

fn extend(step: u64, items: Vec<ExtendItem>) -> StepExtend {
    StepExtend {
        batch: Batch {
            step: Step(step),
            ..Batch::default()
        },
        items,
    }
}

/// A pool of 4 blocks of 4 tokens, full: sequences 1 and 2 hold 2 blocks
/// each, leased at step 1.
fn full_pool() -> Fixture {
    let mut f = Fixture::new(4, &[(0, 4)]);
    let out = f.lease(
        1,
        false,
        &[spec(1, Prompt::Count(8)), spec(2, Prompt::Count(8))],
    );
    assert!(out.iter().all(|o| o.grant().is_some()), "{out:?}");
    f
}

/// Rule 1: the release comes before the completion, so a release fenced at
/// the step the same call completes is fenced, then returned by it.
#[test]
fn a_steps_release_is_fenced_before_its_completion_returns_the_blocks() {
    let mut f = full_pool();
    let out = f
        .step(&StepParts {
            release: Some(release(&[1], Some(1))),
            complete: Some(Step(1)),
            extend: None,
        })
        .unwrap();
    let released = out.released.expect("a release answer");
    assert_eq!(released[0].status, ReleaseStatus::Released);
    assert_eq!(
        (released[0].blocks_fenced, released[0].blocks_freed),
        (2, 0),
        "fenced at a step not yet complete"
    );
    assert_eq!(out.returned, Some(2), "the completion returns the fence");
    assert!(out.extended.is_none(), "a part left out has no answer");
    let c = f.counts()[0];
    assert_eq!((c.in_use, c.fenced), (2, 0), "{c:?}");
}

/// Rule 2: the completion comes before the extend, so an extend in a full
/// pool is granted from the blocks the same call's completion returned.
#[test]
fn a_steps_extend_is_granted_from_the_blocks_its_completion_returned() {
    let mut f = full_pool();
    let rel = f.release(&[1], Some(1));
    assert_eq!(rel[0].blocks_fenced, 2);
    let out = f
        .step(&StepParts {
            release: None,
            complete: Some(Step(1)),
            extend: Some(extend(
                2,
                vec![ExtendItem::grow(SeqId(2), Growth::Count(4))],
            )),
        })
        .unwrap();
    assert_eq!(out.returned, Some(2));
    let extended = out.extended.expect("an extend answer");
    assert!(extended[0].grant().is_some(), "{extended:?}");
}

/// Rule 3: the release comes before the extend, so an extend in a full pool
/// is granted from the blocks the same call's (unfenced) release freed.
#[test]
fn a_steps_extend_is_granted_from_the_blocks_its_release_freed() {
    let mut f = full_pool();
    let out = f
        .step(&StepParts {
            release: Some(release(&[1], None)),
            complete: None,
            extend: Some(extend(
                2,
                vec![ExtendItem::grow(SeqId(2), Growth::Count(4))],
            )),
        })
        .unwrap();
    assert_eq!(out.released.expect("a release answer")[0].blocks_freed, 2);
    assert!(out.returned.is_none(), "a part left out has no answer");
    let extended = out.extended.expect("an extend answer");
    assert!(extended[0].grant().is_some(), "{extended:?}");
    // the same growth alone, with the pool full again, is refused: the
    // order above is what granted it
    let out = f.lease(2, false, &[spec(3, Prompt::Count(4))]);
    assert!(out[0].grant().is_some(), "{out:?}");
    let out = f
        .step(&StepParts {
            extend: Some(extend(
                3,
                vec![ExtendItem::grow(SeqId(2), Growth::Count(4))],
            )),
            ..StepParts::default()
        })
        .unwrap();
    let refused = out.extended.expect("an extend answer");
    assert_eq!(
        refused[0].reject().map(|r| r.reason),
        Some(RejectReason::PoolExhausted),
        "{refused:?}"
    );
}

/// Rule 4: every part is checked before any is applied: an extend item whose
/// progress passes its sequence's length fails the call, and neither the
/// release nor the completion before it happened.
#[test]
fn a_step_with_a_malformed_part_applies_nothing() {
    let mut f = full_pool();
    let before = f.counts();
    let err = f
        .step(&StepParts {
            release: Some(release(&[1], None)),
            complete: Some(Step(1)),
            extend: Some(extend(
                2,
                vec![ExtendItem {
                    seq_id: SeqId(2),
                    growth: None,
                    written_tokens: 99,
                    from_length: None,
                }],
            )),
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("written_tokens 99")),
        "{err}"
    );
    assert_eq!(f.counts(), before, "the release was not applied");
    // step 1 is not complete: a lease at it is still taken
    let out = f.lease(1, false, &[spec(3, Prompt::Count(1))]);
    assert_eq!(out.len(), 1);
    assert_eq!(
        f.release(&[1], None)[0].status,
        ReleaseStatus::Released,
        "sequence 1 was still held"
    );
}
