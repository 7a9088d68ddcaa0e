//! `Step` over real gRPC: each part's answer, a malformed part failing the
//! whole call, chunked-prefill progress and releases after a failed pass.
//! The order of the parts is the core's (`Cache::step`, unit-tested there);
//! these check that the wire carries it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod common;

use common::*;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tonic::Code;
use tonic::transport::Channel;

/// `Step` applies its release, then its completion, then its extends, under
/// one lock: a full pool's extend is granted from the blocks the release and
/// the completion of the same call returned.
#[tokio::test]
async fn step_applies_release_then_complete_then_extend() {
    let (mut s, sess) = Server::with_session(config(), 6).await;
    let c = &mut s.client;
    // two sequences of 12 tokens fill the full-attention pool (3 + 3 blocks)
    let out = lease(
        c,
        sess,
        1,
        vec![seq(1, (0..12).collect()), seq(2, (100..112).collect())],
    )
    .await;
    grant(&out[0]);
    grant(&out[1]);
    let r = c
        .step(step_req(
            sess,
            Some(step_release(vec![1], Some(1))),
            Some(1),
            Some(step_extend(2, vec![ext_item(2, vec![112])])),
        ))
        .await
        .unwrap()
        .into_inner();
    let release = r.release.expect("a release part");
    assert_eq!(release.results[0].status(), pb::ReleaseStatus::Released);
    assert!(release.results[0].blocks_fenced > 0, "{release:?}");
    let complete = r.complete.expect("a complete part");
    assert!(complete.blocks_returned >= 3, "{complete:?}");
    let extend = r.extend.expect("an extend part");
    assert_eq!(grant(&extend.outcomes[0]).seq_id, 2);

    // A part left out has no answer; the same extend alone, with the pool
    // full again, is refused: the order above is what granted it.
    let out = lease(c, sess, 2, vec![seq(3, (200..208).collect())]).await;
    grant(&out[0]);
    let r = c
        .step(step_req(
            sess,
            None,
            None,
            Some(step_extend(3, vec![ext_item(3, (208..213).collect())])),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(r.release.is_none() && r.complete.is_none());
    let refused = r.extend.expect("an extend part");
    assert_eq!(
        reject(&refused.outcomes[0]).reason(),
        pb::RejectReason::PoolExhausted
    );
    s.shutdown().await;
}

/// A malformed part fails the whole `Step` before any part is applied.
#[tokio::test]
async fn a_malformed_step_applies_nothing() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let out = lease(c, sess, 1, vec![seq(1, (0..8).collect())]).await;
    grant(&out[0]);
    let release_1 = || Some(step_release(vec![1], None));
    let mut both = ext_item(1, vec![8]);
    both.num_tokens = 2;
    assert_status(
        c.step(step_req(
            sess,
            release_1(),
            Some(1),
            Some(step_extend(2, vec![both])),
        ))
        .await,
        Code::InvalidArgument,
        "only one of",
    );
    assert_status(
        c.step(step_req(
            sess,
            Some(step_release((0..9).collect(), None)),
            None,
            None,
        ))
        .await,
        Code::ResourceExhausted,
        "batch limit is 8",
    );
    assert_status(
        c.step(step_req((sess.0 + 1000, sess.1), release_1(), None, None))
            .await,
        Code::FailedPrecondition,
        "unknown session",
    );
    // sequence 1 is still held: the refused calls released nothing
    let st = stats(c).await;
    assert!(st.pools.iter().any(|p| p.in_use > 0), "{st:?}");
    let rel = c
        .step(step_req(sess, release_1(), None, None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rel.release.unwrap().results[0].status(),
        pb::ReleaseStatus::Released
    );
    s.shutdown().await;
}

/// Chunked prefill: `prefill_tokens` past the prompt and `written_tokens`
/// past the sequence are INVALID_ARGUMENT naming both figures (a `Step`
/// carrying such an item applies none of its parts); a progress report in a
/// `Step` publishes the held-back blocks it covers at the step's completion.
#[tokio::test]
async fn chunked_prefill_figures_are_checked_and_progress_publishes() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let prompt: Vec<u32> = (100..116).collect();
    let mut too_long = seq(1, prompt.clone());
    too_long.prefill_tokens = 17;
    assert_status(
        c.lease(lease_req(sess, 1, vec![too_long])).await,
        Code::InvalidArgument,
        "prefill_tokens 17 is beyond its prompt of 16 tokens",
    );
    let mut first = seq(1, prompt.clone());
    first.prefill_tokens = 4;
    let out = lease(c, sess, 1, vec![first]).await;
    assert_eq!(grant(&out[0]).reused_tokens, 0);
    assert_status(
        c.extend(extend_req(sess, 1, vec![progress_item(1, 17)]))
            .await,
        Code::InvalidArgument,
        "written_tokens 17 is beyond its length of 16 tokens",
    );
    // The same inside Step: its release of the sequence is not applied.
    assert_status(
        c.step(step_req(
            sess,
            Some(step_release(vec![1], None)),
            None,
            Some(step_extend(1, vec![progress_item(1, 17)])),
        ))
        .await,
        Code::InvalidArgument,
        "written_tokens 17 is beyond its length of 16 tokens",
    );
    // Step 1 wrote the first block only; step 2 writes through token 12.
    let r = c
        .step(step_req(
            sess,
            None,
            Some(1),
            Some(step_extend(2, vec![progress_item(1, 12)])),
        ))
        .await
        .unwrap()
        .into_inner();
    let progress = r.extend.expect("an extend part");
    assert!(grant(&progress.outcomes[0]).tables.is_empty());
    let reused = |out: &[pb::SequenceOutcome]| grant(&out[0]).reused_tokens;
    let out = lease(c, sess, 2, vec![seq(2, prompt.clone())]).await;
    assert_eq!(reused(&out), 4, "blocks of later chunks are not reused");
    let r = c
        .step(step_req(
            sess,
            Some(step_release(vec![2], None)),
            Some(2),
            None,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(r.complete.is_some());
    let out = lease(c, sess, 3, vec![seq(3, prompt)]).await;
    assert_eq!(reused(&out), 12, "the reported blocks publish");
    s.shutdown().await;
}

/// A release after a failed forward pass (`discard_unwritten`), through
/// `Release` and through `Step`: the blocks stay fenced until the step
/// completes, and then nothing they hold is reused; the same fenced release
/// without the flag publishes at completion, as before.
#[tokio::test]
async fn a_release_after_a_failed_pass_publishes_nothing() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let reused = |out: &[pb::SequenceOutcome]| grant(&out[0]).reused_tokens;
    let lease_one = async |c: &mut CacheServiceClient<Channel>, step, seq_id, tokens| {
        lease(c, sess, step, vec![seq(seq_id, tokens)]).await
    };
    let step_release = |seq_id, step, discard_unwritten| {
        let mut part = step_release(vec![seq_id], Some(step));
        part.discard_unwritten = discard_unwritten;
        step_req(sess, Some(part), Some(step), None)
    };

    // Release, then CompleteStep
    lease_one(c, 1, 1, (0..9).collect()).await;
    let released = c
        .release(pb::ReleaseRequest {
            discard_unwritten: true,
            ..release_req(sess, vec![1], Some(1))
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(released[0].status(), pb::ReleaseStatus::Released);
    assert!(released[0].blocks_fenced > 0, "{released:?}");
    assert_eq!(released[0].blocks_freed, 0, "{released:?}");
    let complete = c
        .complete_step(complete_req(sess, 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        complete.blocks_returned,
        u64::from(released[0].blocks_fenced)
    );
    let out = lease_one(c, 2, 2, (0..10).collect()).await;
    assert_eq!(reused(&out), 0, "through Release");

    // one Step: the release with the flag, then the completion
    lease_one(c, 3, 3, (100..109).collect()).await;
    let r = c.step(step_release(3, 3, true)).await.unwrap().into_inner();
    let release = r.release.expect("a release part");
    assert!(release.results[0].blocks_fenced > 0, "{release:?}");
    let out = lease_one(c, 4, 4, (100..110).collect()).await;
    assert_eq!(reused(&out), 0, "through Step");

    // the same Step without the flag publishes what step 5 wrote
    lease_one(c, 5, 5, (200..209).collect()).await;
    c.step(step_release(5, 5, false)).await.unwrap();
    let out = lease_one(c, 6, 6, (200..210).collect()).await;
    assert!(reused(&out) >= 8, "{out:?}");

    let audit = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    s.shutdown().await;
}
