//! Who may pull a worker's blocks (`PullBlocks`, peer pull), over mTLS:
//! its owner, or a caller presenting a `worker` certificate acting for the
//! owner; another owner's worker, another owner and a plain client are
//! PERMISSION_DENIED, a caller without a certificate UNAUTHENTICATED.
//! Malformed pulls are INVALID_ARGUMENT naming the entry, and the worker
//! serves on. (A process of its own: the mTLS certificates set the test
//! process's client identity.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use kvlease_integration_tests::secure::{channel_as, security_args};
use kvlease_integration_tests::{Service, small_worker, start_worker};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use tonic::Code;

/// A PullBlocks of `blocks` as `name` (no certificate: `None`), naming
/// `pull_for` in the pull's metadata; its first answer.
async fn pull_as(
    worker: &Service,
    name: Option<&str>,
    pull_for: Option<&str>,
    identity: (&str, &str),
    blocks: &[(u32, u32)],
) -> Result<Vec<pb::BlockChunk>, tonic::Status> {
    let channel = match channel_as(worker.addr, name).await {
        Ok(c) => c,
        Err(e) => return Err(tonic::Status::unauthenticated(e.to_string())),
    };
    let mut request = tonic::Request::new(pb::PullBlocksRequest {
        transfer_id: 1,
        tokenizer_fingerprint: identity.0.into(),
        kv_dtype: identity.1.into(),
        blocks: blocks
            .iter()
            .map(|&(window, block)| pb::PeerBlock {
                window,
                block,
                tokens: 0,
            })
            .collect(),
    });
    if let Some(owner) = pull_for {
        request
            .metadata_mut()
            .insert("kvlease-pull-for", owner.parse().unwrap());
    }
    let mut stream = WorkerServiceClient::new(channel)
        .pull_blocks(request)
        .await?
        .into_inner();
    let mut chunks = Vec::new();
    while let Some(c) = stream.message().await? {
        chunks.push(c);
    }
    Ok(chunks)
}

#[tokio::test]
async fn only_the_owner_or_a_worker_acting_for_it_may_pull_and_malformed_pulls_are_named() {
    let worker = start_worker(worker_svc::Config {
        security: security_args("worker"),
        owner: Some("scheduler".into()),
        ..small_worker()
    })
    .await
    .unwrap();
    let channel = channel_as(worker.addr, Some("scheduler")).await.unwrap();
    let d = WorkerServiceClient::new(channel)
        .describe(pb::DescribeRequest {})
        .await
        .unwrap()
        .into_inner();
    let fingerprint = d.model.unwrap().tokenizer_fingerprint;
    let id = (fingerprint.as_str(), d.kv_dtype.as_str());
    let code = |r: Result<Vec<pb::BlockChunk>, tonic::Status>| match r {
        Ok(chunks) => panic!("served {} chunks", chunks.len()),
        Err(s) => (s.code(), s.message().to_string()),
    };
    // allowed: the owner, and a worker acting for it. Block 0 of a fresh
    // worker holds no K/V, which is what they are told (past the auth)
    let unwritten = "peer pull: block 0 of the pool of window 0 does not hold K/V in every slot";
    for (name, pull_for) in [("scheduler", None), ("worker", Some("scheduler"))] {
        let (c, m) = code(pull_as(&worker, Some(name), pull_for, id, &[(0, 0)]).await);
        assert_eq!(
            (c, m.as_str()),
            (Code::FailedPrecondition, unwritten),
            "{name}"
        );
    }
    // refused: another owner's worker, another owner, a plain client (even
    // naming the owner: only a worker's certificate may act for one)
    for (name, pull_for, who) in [
        ("worker", Some("mallory"), "mallory"),
        ("mallory", None, "mallory"),
        ("alice", None, "alice"),
        ("alice", Some("scheduler"), "alice"),
    ] {
        let (c, m) = code(pull_as(&worker, Some(name), pull_for, id, &[(0, 0)]).await);
        assert_eq!(c, Code::PermissionDenied, "{name}: {m}");
        assert_eq!(
            m,
            format!(
                "this worker serves only its owner scheduler; principal {who} may not PullBlocks"
            )
        );
    }
    // no certificate at all (refused at the handshake or by the layer)
    let (c, _) = code(pull_as(&worker, None, None, id, &[(0, 0)]).await);
    assert_eq!(c, Code::Unauthenticated);
    // malformed, from the owner: named, and the worker serves on
    let owner =
        |blocks: &'static [(u32, u32)]| pull_as(&worker, Some("scheduler"), None, id, blocks);
    let (c, m) = code(owner(&[]).await);
    assert_eq!(
        (c, m.as_str()),
        (
            Code::InvalidArgument,
            "blocks must name 1 to 4096 blocks, got 0"
        )
    );
    let (c, m) = code(owner(&[(0, 0), (5, 0)]).await);
    assert_eq!(
        (c, m.as_str()),
        (
            Code::InvalidArgument,
            "blocks[1]: the model has no pool of window 5"
        )
    );
    let (c, m) = code(owner(&[(0, 1 << 30)]).await);
    assert_eq!(c, Code::InvalidArgument);
    assert!(
        m.starts_with("blocks[0]: block 1073741824 is out of range"),
        "{m}"
    );
    let (c, m) = code(
        pull_as(
            &worker,
            Some("scheduler"),
            None,
            ("0123456789abcdef", id.1),
            &[(0, 0)],
        )
        .await,
    );
    assert_eq!(c, Code::FailedPrecondition);
    assert!(m.contains("fingerprint"), "{m}");
    let (c, _) = code(owner(&[(0, 0)]).await);
    assert_eq!(c, Code::FailedPrecondition, "still serving");
    worker.stop().await.unwrap();
}
