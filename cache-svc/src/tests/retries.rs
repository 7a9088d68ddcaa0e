//! A growth sent again after its answer was lost: with `from_length`, the
//! retry of a growth the cache applied is refused `LENGTH_MISMATCH` and
//! takes nothing, instead of recording its tokens a second time.

use super::{Fixture, spec, tokens};
use crate::cache::Batch;
use crate::ids::{SeqId, Step};
use crate::lease::{ExtendItem, Growth, Outcome, Prompt, RejectReason};

impl Fixture {
    fn grow(&mut self, step: u64, seq_id: u64, from: Option<u32>, new: Vec<u32>) -> Outcome {
        let item = ExtendItem {
            from_length: from,
            ..ExtendItem::grow(SeqId(seq_id), Growth::Tokens(new))
        };
        let batch = Batch {
            step: Step(step),
            ..Batch::default()
        };
        let mut out = self
            .cache
            .extend_items(self.session, self.epoch, batch, &[item], self.now)
            .unwrap();
        self.check();
        out.remove(0)
    }
}

#[test]
fn a_growth_sent_again_from_the_length_it_already_grew_from_is_refused_and_takes_nothing() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(1, 4)))]);
    let first = f.grow(2, 1, Some(4), vec![5, 6]);
    assert_eq!(first.grant().expect("granted").tables[0].block_ids.len(), 1);
    let held = f.counts()[0].in_use;

    // its answer lost, the holder sends it again from the same length
    let again = f.grow(3, 1, Some(4), vec![5, 6]);
    let Outcome::Reject(r) = again else {
        panic!("a retry of an applied growth is refused: {again:?}")
    };
    assert_eq!(r.reason, RejectReason::LengthMismatch);
    assert!(
        r.message.contains("6 tokens long") && r.message.contains("the 4"),
        "{}",
        r.message
    );
    assert_eq!(f.counts()[0].in_use, held, "nothing taken");

    // from the cache's length it grows; unchecked without a length
    assert!(f.grow(3, 1, Some(6), vec![7, 8, 9]).grant().is_some());
    assert!(f.grow(4, 1, None, vec![10]).grant().is_some());
    assert!(matches!(
        f.grow(4, 1, Some(9), vec![11]),
        Outcome::Reject(r) if r.reason == RejectReason::LengthMismatch
    ));
    f.release(&[1], None);
    f.complete(4);
    assert!(super::whole(&f.counts()));
}

#[test]
fn a_length_given_for_a_sequence_the_session_does_not_hold_is_unknown_sequence() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    let out = f.grow(1, 7, Some(4), vec![5]);
    assert!(
        matches!(&out, Outcome::Reject(r) if r.reason == RejectReason::UnknownSequence),
        "{out:?}"
    );
}
