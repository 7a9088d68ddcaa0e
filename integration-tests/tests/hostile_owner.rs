//! Issue 29, finding 7: a worker started over mTLS without `--owner` belonged to whoever
//! called Forward first. Now it refuses to start; first come, first owner takes the explicit
//! `--owner-first-caller`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use kvlease_integration_tests::secure::{channel_as, security_args};
use kvlease_integration_tests::{small_worker, start_worker};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use tonic::Code;

async fn forward_as(addr: std::net::SocketAddr, name: &str) -> Result<(), tonic::Status> {
    let channel = channel_as(addr, Some(name)).await.unwrap();
    WorkerServiceClient::new(channel)
        .forward(pb::ForwardRequest::default())
        .await
        .map(drop)
}

#[tokio::test]
async fn a_secured_worker_without_an_owner_does_not_start() {
    let started = start_worker(worker_svc::Config {
        security: security_args("worker"),
        ..small_worker()
    })
    .await;
    let e = match started {
        Ok(worker) => {
            // the old behaviour: mallory's first Forward made her its owner
            let mallory = forward_as(worker.addr, "mallory").await;
            panic!("a worker under mTLS started without --owner; mallory's Forward: {mallory:?}");
        }
        Err(e) => e.to_string(),
    };
    assert!(e.contains("--owner is required"), "{e}");
}

#[tokio::test]
async fn first_come_ownership_takes_the_explicit_flag() {
    let worker = start_worker(worker_svc::Config {
        security: security_args("worker"),
        owner_first_caller: true,
        ..small_worker()
    })
    .await
    .unwrap();
    // mallory calls first: the worker is hers, as the operator chose
    let first = forward_as(worker.addr, "mallory").await;
    assert!(
        first
            .as_ref()
            .err()
            .is_none_or(|s| s.code() != Code::PermissionDenied),
        "{first:?}"
    );
    let then = forward_as(worker.addr, "scheduler").await.unwrap_err();
    assert_eq!(then.code(), Code::PermissionDenied);
    assert!(then.message().contains("owner mallory"), "{then:?}");
    worker.stop().await.unwrap();
}
