//! Chunked prefill: blocks publish only as far as the holder reports them
//! written.

use std::time::Duration;

use super::{Fixture, spec, tokens, whole};
use crate::cache::Batch;
use crate::ids::{SeqId, Step};
use crate::lease::{Outcome, Prompt, RejectReason, SeqSpec};
fn chunked(seq_id: u64, prompt: Vec<u32>, prefill_tokens: u32) -> SeqSpec {
    SeqSpec {
        prefill_tokens,
        ..spec(seq_id, Prompt::Tokens(prompt))
    }
}

impl Fixture {
    fn progress(&mut self, step: u64, seq_id: u64, written: u32) -> Vec<Outcome> {
        let out = self
            .cache
            .extend_items(
                self.session,
                self.epoch,
                Batch {
                    step: Step(step),
                    ..Batch::default()
                },
                &[crate::lease::ExtendItem::written(SeqId(seq_id), written)],
                self.now,
            )
            .unwrap();
        self.check();
        out
    }

    fn reused(&mut self, step: u64, spec: SeqSpec) -> u32 {
        let out = self.lease(step, false, &[spec]);
        out[0].grant().expect("granted").reused_tokens
    }
}

#[test]
fn chunked_prefill_publishes_only_the_blocks_reported_written() {
    let mut f = Fixture::new(16, &[(0, 64)]);
    let prompt = tokens(1, 64);
    // The lease's step computes the first chunk (16 tokens) of 64.
    assert_eq!(f.reused(1, chunked(1, prompt.clone(), 16)), 0);
    f.complete(1);
    // Only the first block is written: a concurrent request with the same
    // prompt must not read the blocks of later chunks.
    assert_eq!(f.reused(2, chunked(2, prompt.clone(), 16)), 16);
    // Released with held-back blocks: nothing of them is published.
    f.release(&[2], None);
    // The second and third chunks of sequence 1 are written by step 2.
    let out = f.progress(2, 1, 48);
    let g = out[0].grant().expect("a progress report is granted");
    assert!(g.tables.is_empty(), "a progress report changes no table");
    assert_eq!(f.reused(2, spec(3, Prompt::Tokens(prompt.clone()))), 16);
    f.release(&[3], None);
    f.complete(2);
    assert_eq!(f.reused(3, spec(4, Prompt::Tokens(prompt.clone()))), 48);
    f.release(&[1, 4], None);
    f.complete(3);
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert!(f.cache.audit().reclaimed.is_empty());
    assert_eq!(f.reused(4, spec(5, Prompt::Tokens(prompt))), 48);
    f.release(&[5], None);

    // A fenced release (as at preemption) publishes what the lease's step
    // wrote, never the held-back blocks.
    let other = tokens(500, 70);
    f.lease(5, false, &[chunked(6, other.clone(), 20)]);
    f.release(&[6], Some(5));
    f.complete(5);
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert_eq!(
        f.cache.pools()[0].pool.partial_blocks(),
        0,
        "the last block of an unfinished prefill is not kept"
    );
    assert_eq!(f.reused(6, spec(7, Prompt::Tokens(other.clone()))), 16);
    f.release(&[7], None);

    // Session expiry drops held-back blocks like pending ones.
    f.lease(7, false, &[chunked(8, tokens(900, 64), 16)]);
    f.progress(7, 8, 32);
    f.now += Duration::from_secs(3600);
    f.cache.expire_sessions(f.now);
    f.check();
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn chunked_prefill_figures_are_checked() {
    let mut f = Fixture::new(16, &[(0, 64)]);
    let err = f
        .cache
        .lease(
            f.session,
            f.epoch,
            Batch {
                step: Step(1),
                ..Batch::default()
            },
            &[chunked(1, tokens(1, 20), 21)],
            f.now,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("prefill_tokens 21 is beyond its prompt of 20 tokens"),
        "{err}"
    );
    f.lease(1, false, &[chunked(1, tokens(1, 20), 20)]);
    let err = f
        .cache
        .extend_items(
            f.session,
            f.epoch,
            Batch {
                step: Step(1),
                ..Batch::default()
            },
            &[crate::lease::ExtendItem::written(SeqId(1), 21)],
            f.now,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("written_tokens 21 is beyond its length of 20 tokens"),
        "{err}"
    );
    // an unknown sequence's report is a reject, not an error
    let out = f.progress(1, 9, 4);
    assert_eq!(
        out[0].reject().map(|r| r.reason),
        Some(RejectReason::UnknownSequence)
    );
}
