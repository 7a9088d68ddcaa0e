//! The cache service over real gRPC on 127.0.0.1:0: every RPC, malformed
//! requests, unknown sessions, stale epochs, double release, limits, health,
//! reflection, and session expiry under paused time. `Step` has its own file
//! (`grpc_step.rs`), and so has the ownership of pool groups
//! (`grpc_ownership.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvlease_proto::v1 as pb;
use tonic::Code;
use tonic::transport::Channel;

#[tokio::test]
async fn register_pool_is_idempotent_and_validated() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    let first = register(c, 16).await;
    assert_eq!(first.len(), 2);
    let again = c
        .register_pool(register_req(
            GROUP,
            4,
            vec![pool_spec(8, 16), pool_spec(0, 16)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(again.already_registered);
    assert_eq!(again.pools[1].pool_id, first[0].pool_id);
    let conflict = c
        .register_pool(register_req(GROUP, 8, vec![pool_spec(0, 16)]))
        .await;
    assert_status(conflict, Code::AlreadyExists, "another geometry");
    let bad = c
        .register_pool(register_req("x", 0, vec![pool_spec(0, 16)]))
        .await;
    assert_status(bad, Code::InvalidArgument, "tokens_per_block");
    let dup = c
        .register_pool(register_req(
            "x",
            4,
            vec![pool_spec(0, 16), pool_spec(0, 8)],
        ))
        .await;
    assert_status(dup, Code::InvalidArgument, "listed twice");
    // a session_id that names no open session: refused before anything is
    // registered
    let mut unknown = register_req("y", 4, vec![pool_spec(0, 16)]);
    unknown.session_id = 7;
    assert_status(
        c.register_pool(unknown).await,
        Code::FailedPrecondition,
        "unknown session 7",
    );
    let stats = c
        .get_stats(pb::GetStatsRequest {
            pool_group: "y".into(),
        })
        .await;
    assert_eq!(stats.map(|_| ()).unwrap_err().code(), Code::NotFound);
    s.shutdown().await;
}

#[tokio::test]
async fn sessions_unknown_stale_and_closed() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    assert_status(
        c.open_session(pb::OpenSessionRequest {
            holder: String::new(),
            ttl_ms: 0,
        })
        .await,
        Code::InvalidArgument,
        "holder",
    );
    let (id, epoch) = open(c).await;
    c.keep_alive(keep_alive_req((id, epoch))).await.unwrap();
    assert_status(
        c.keep_alive(keep_alive_req((id + 100, epoch))).await,
        Code::FailedPrecondition,
        "unknown session",
    );
    assert_status(
        c.lease(lease_req((id, epoch + 1), 1, vec![seq(1, vec![1, 2])]))
            .await,
        Code::FailedPrecondition,
        "stale epoch",
    );
    c.lease(lease_req((id, epoch), 1, vec![seq(1, vec![1, 2, 3, 4, 5])]))
        .await
        .unwrap();
    let closed = c
        .close_session(close_req((id, epoch)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(closed.sequences_released, 1);
    assert_eq!(closed.blocks_returned, 4, "two blocks in each pool");
    assert_status(
        c.keep_alive(keep_alive_req((id, epoch))).await,
        Code::FailedPrecondition,
        "unknown session",
    );
    s.shutdown().await;
}

#[tokio::test]
async fn lease_extend_release_complete_and_stats() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    let pools = register(c, 6).await;
    let sess = open(c).await;
    let prompt: Vec<u32> = (0..9).collect();
    let out = c
        .lease(lease_req(
            sess,
            1,
            vec![seq(1, prompt.clone()), {
                let mut big = seq(2, Vec::new());
                big.num_tokens = 100;
                big
            }],
        ))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    let g = grant(&out[0]);
    assert_eq!(g.tables.len(), 2);
    assert_eq!(g.tables[0].block_ids.len(), 3);
    assert_eq!(g.capacity_tokens, 9);
    let r = reject(&out[1]);
    assert_eq!(r.reason(), pb::RejectReason::ExceedsCapacity);
    assert_eq!(r.blocks_needed, 25);
    assert_eq!(r.blocks_free, 3);
    assert!(!r.message.is_empty());

    let ext = c
        .extend(extend_req(
            sess,
            2,
            vec![
                ext_item(1, vec![9, 10, 11, 12]),
                pb::ExtendItem {
                    num_tokens: 1,
                    ..ext_item(77, vec![])
                },
            ],
        ))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    // An extend grant is a delta: 9 -> 13 tokens appends one block per pool.
    let delta = grant(&ext[0]);
    assert_eq!(delta.tables[0].block_ids.len(), 1);
    assert_eq!(delta.tables[0].first_block, 0);
    assert!(
        !g.tables[0]
            .block_ids
            .contains(&delta.tables[0].block_ids[0])
    );
    assert_eq!(reject(&ext[1]).reason(), pb::RejectReason::UnknownSequence);

    let done = c
        .complete_step(complete_req(sess, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.blocks_returned, 0);

    let rel = c
        .release(release_req(sess, vec![1], Some(3)))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(rel[0].status(), pb::ReleaseStatus::Released);
    assert!(rel[0].blocks_fenced > 0);
    let twice = c
        .release(release_req(sess, vec![1, 5], None))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(twice[0].status(), pb::ReleaseStatus::AlreadyReleased);
    assert_eq!(twice[0].blocks_freed, 0);
    assert_eq!(twice[1].status(), pb::ReleaseStatus::Unknown);

    let stats = stats(c).await;
    assert_eq!(stats.epoch, sess.1);
    let full = stats
        .pools
        .iter()
        .find(|p| p.pool_id == pools[0].pool_id)
        .unwrap();
    assert_eq!(full.fenced, 4);
    assert_eq!(
        full.free + full.cached_evictable + full.in_use + full.fenced,
        full.total
    );
    let freed = c
        .complete_step(complete_req(sess, 3))
        .await
        .unwrap()
        .into_inner();
    assert!(freed.blocks_returned >= 4);
    let stats = c
        .get_stats(pb::GetStatsRequest {
            pool_group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner();
    for p in &stats.pools {
        assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
    }
    assert_status(
        c.get_stats(pb::GetStatsRequest {
            pool_group: "nope".into(),
        })
        .await,
        Code::NotFound,
        "unknown pool group",
    );
    s.shutdown().await;
}

#[tokio::test]
async fn malformed_requests_are_invalid_argument_and_limits_resource_exhausted() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let mut both = seq(1, vec![1]);
    both.num_tokens = 3;
    assert_status(
        c.lease(lease_req(sess, 1, vec![both])).await,
        Code::InvalidArgument,
        "only one of",
    );
    assert_status(
        c.lease(lease_req(sess, 1, vec![seq(1, vec![])])).await,
        Code::InvalidArgument,
        "num_tokens > 0",
    );
    let mut prio = seq(1, vec![1]);
    prio.priority = 101;
    assert_status(
        c.lease(lease_req(sess, 1, vec![prio])).await,
        Code::InvalidArgument,
        "priority",
    );
    for (tokens, priority, ttl_ms, field) in [
        (0, 0, 1_000, "retain.tokens"),
        (2, 0, 1_000, "retain.tokens"),
        (1, 300, 1_000, "retain.priority"),
        (1, 0, 0, "retain.ttl_ms"),
        (1, 0, 86_400_001, "retain.ttl_ms"),
    ] {
        let mut hinted = seq(1, vec![1]);
        hinted.retain = Some(pb::RetentionHint {
            tokens,
            priority,
            ttl_ms,
            tenant: String::new(),
        });
        let got = c.lease(lease_req(sess, 1, vec![hinted])).await;
        assert_status(got, Code::InvalidArgument, field);
    }
    // a tenant name past the bound is refused, quoted clipped
    let mut long_tenant = seq(1, vec![1]);
    long_tenant.retain = Some(pb::RetentionHint {
        tokens: 1,
        priority: 0,
        ttl_ms: 1_000,
        tenant: "t".repeat(1 << 20),
    });
    let refused = c
        .lease(lease_req(sess, 1, vec![long_tenant]))
        .await
        .expect_err("a 1 MB tenant");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("retain.tenant must be at most 256 bytes")
            && refused.message().len() < 1024,
        "{}",
        &refused.message()[..refused.message().len().min(300)]
    );
    let mut group = seq(1, vec![1]);
    group.pool_group = "other".into();
    assert_status(
        c.lease(lease_req(sess, 1, vec![group])).await,
        Code::NotFound,
        "unknown pool group",
    );
    // a name nobody registered is named back clipped: a 1 MB one echoed
    // whole went over the message cap (issue 29, point 9)
    let mut huge = seq(1, vec![1]);
    huge.pool_group = "g".repeat(1 << 20);
    let refused = c
        .lease(lease_req(sess, 1, vec![huge]))
        .await
        .expect_err("an unknown group");
    let message = refused.message();
    assert_eq!(
        refused.code(),
        Code::NotFound,
        "{}",
        &message[..message.len().min(300)]
    );
    assert!(message.len() < 1024, "a {} byte message", message.len());
    assert!(message.contains("(1048576 bytes)"), "{message}");
    let many: Vec<_> = (0..9).map(|i| seq(i, vec![1])).collect();
    assert_status(
        c.lease(lease_req(sess, 1, many)).await,
        Code::ResourceExhausted,
        "batch limit is 8",
    );
    assert_status(
        c.extend(extend_req(sess, 1, vec![ext_item(1, vec![])]))
            .await,
        Code::InvalidArgument,
        "num_tokens > 0",
    );
    assert_status(
        c.estimate(pb::EstimateRequest {
            shapes: vec![seq(1, vec![])],
        })
        .await,
        Code::InvalidArgument,
        "num_tokens",
    );
    // Nothing was taken by any refused call.
    let stats = stats(c).await;
    assert!(stats.pools.iter().all(|p| p.free == p.total));
    s.shutdown().await;
}

/// `LeaseRequest` as any client can send it: its 32-bit numbers 64 bits wide.
#[derive(Clone, PartialEq, prost::Message)]
struct WideLease {
    #[prost(uint64, tag = "1")]
    session_id: u64,
    #[prost(uint64, tag = "2")]
    epoch: u64,
    #[prost(uint64, tag = "3")]
    step: u64,
    #[prost(message, repeated, tag = "5")]
    sequences: Vec<WideSpec>,
}

/// `SequenceSpec`, likewise.
#[derive(Clone, PartialEq, prost::Message)]
struct WideSpec {
    #[prost(uint64, tag = "1")]
    seq_id: u64,
    #[prost(string, tag = "2")]
    pool_group: String,
    #[prost(uint64, repeated, tag = "3")]
    prompt_tokens: Vec<u64>,
    #[prost(uint64, tag = "8")]
    priority: u64,
}

/// prost reads a uint32 by truncating the number on the wire: a priority of
/// 2^32 + 50 was leased at priority 50, a token id of 2^32 + 2 as token 2
/// (issue 29, point 9). The codec refuses them, naming the field.
#[tokio::test]
async fn a_32_bit_field_sent_wider_is_invalid_argument_not_truncated() {
    let (s, sess) = Server::with_session(config(), 16).await;
    let channel = Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let lease = |priority: u64, token: u64| WideLease {
        session_id: sess.0,
        epoch: sess.1,
        step: 1,
        sequences: vec![WideSpec {
            seq_id: 1,
            pool_group: GROUP.into(),
            prompt_tokens: vec![1, token],
            priority,
        }],
    };
    let mut send = async |wide: WideLease| {
        grpc.ready().await.unwrap();
        grpc.unary::<_, pb::LeaseResponse, _>(
            tonic::Request::new(wide),
            tonic::codegen::http::uri::PathAndQuery::from_static("/kvlease.v1.CacheService/Lease"),
            kvlease_proto::codec::Codec::default(),
        )
        .await
    };
    assert_status(
        send(lease((1 << 32) + 50, 2)).await,
        Code::InvalidArgument,
        "LeaseRequest.sequences.priority is 4294967346, over its 32-bit limit of 4294967295",
    );
    assert_status(
        send(lease(50, (1 << 32) + 2)).await,
        Code::InvalidArgument,
        "LeaseRequest.sequences.prompt_tokens is 4294967298, over its 32-bit limit",
    );
    // nothing was leased, and the same lease with numbers that fit is granted
    let granted = send(lease(50, 2)).await.unwrap().into_inner();
    assert!(
        matches!(
            granted.outcomes[0].outcome,
            Some(pb::sequence_outcome::Outcome::Grant(_))
        ),
        "{granted:?}"
    );
    s.shutdown().await;
}

#[tokio::test]
async fn oversized_message_is_resource_exhausted() {
    let (mut s, sess) = Server::with_session(
        cache_svc::Config {
            max_message_bytes: 4096,
            ..config()
        },
        16,
    )
    .await;
    let c = &mut s.client;
    let huge = seq(1, (0..5000).collect());
    assert_status(
        c.lease(lease_req(sess, 1, vec![huge])).await,
        Code::ResourceExhausted,
        "the limit is: 4096 bytes",
    );
    s.shutdown().await;
}

/// A holder learns the batch limit from `OpenSession`, so it can split its
/// batches instead of finding the limit by a refusal: a list of exactly
/// that many entries is taken, one more is refused.
#[tokio::test]
async fn open_session_advertises_the_batch_limit_it_enforces() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 64).await;
    let opened = open_session(c).await;
    assert_eq!(opened.max_batch, 8);
    let sess = (opened.session_id, opened.epoch);
    let at_limit: Vec<_> = (1..=8).map(|i| seq(i, vec![1])).collect();
    c.lease(lease_req(sess, 1, at_limit)).await.unwrap();
    let release = |seq_ids: Vec<u64>| release_req(sess, seq_ids, None);
    assert_status(
        c.release(release((1..=9).collect())).await,
        Code::ResourceExhausted,
        "batch limit is 8",
    );
    c.release(release((1..=8).collect())).await.unwrap();
    s.shutdown().await;
}

#[tokio::test]
async fn estimate_counts_draft_tokens() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let mut shape = seq(0, vec![]);
    shape.num_tokens = 8;
    shape.max_new_tokens = 9;
    let plain = c
        .estimate(pb::EstimateRequest {
            shapes: vec![shape.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    shape.extra = Some(pb::ExtraTokens {
        draft: 4,
        extra_kv: 0,
        extra_decoding_steps: 0,
    });
    let drafted = c
        .estimate(pb::EstimateRequest {
            shapes: vec![shape],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(plain.estimates[0].pools[0].total_blocks, 4);
    assert_eq!(drafted.estimates[0].pools[0].total_blocks, 5);
    assert!(drafted.estimates[0].fits);
    s.shutdown().await;
}

#[tokio::test]
async fn watch_events_streams_stored_hashes_and_audit_finds_nothing() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let mut stream = c
        .watch_events(pb::WatchEventsRequest { after_id: 0 })
        .await
        .unwrap()
        .into_inner();
    c.lease(lease_req(sess, 1, vec![seq(1, (0..9).collect())]))
        .await
        .unwrap();
    c.complete_step(complete_req(sess, 1)).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("an event within 5 s")
        .unwrap()
        .unwrap();
    assert_eq!(first.id, 1);
    match first.kind {
        Some(pb::cache_event::Kind::Stored(st)) => {
            assert_eq!(st.block_hashes.len(), 2);
            assert_eq!(st.parent_hash, 0);
        }
        other => panic!("expected stored, got {other:?}"),
    }
    let audit = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
    assert_eq!(audit.blocks_checked, 32);
    assert!(audit.reclaimed.is_empty());
    s.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_expired_session_is_reclaimed_with_its_fences() {
    let (mut s, sess) = Server::with_session(
        cache_svc::Config {
            session_ttl_ms: 2_000,
            ..config()
        },
        16,
    )
    .await;
    let c = &mut s.client;
    c.lease(lease_req(
        sess,
        1,
        vec![seq(1, (0..9).collect()), seq(2, (50..59).collect())],
    ))
    .await
    .unwrap();
    c.release(release_req(sess, vec![2], Some(1)))
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(3)).await;
    // Let the housekeeping task run its expiry tick.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let stats = stats(c).await;
    assert_eq!(stats.sessions, 0);
    for p in &stats.pools {
        assert_eq!((p.in_use, p.fenced, p.free), (0, 0, p.total), "{p:?}");
    }
    assert_status(
        c.keep_alive(keep_alive_req(sess)).await,
        Code::FailedPrecondition,
        "unknown session",
    );
    s.shutdown().await;
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let s = Server::start(config()).await;
    let channel = Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kvlease.v1.CacheService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    let names = listed_services(channel).await;
    assert!(
        names.contains(&"kvlease.v1.CacheService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
    s.shutdown().await;
}

/// The services gRPC reflection (v1) lists on `channel`.
async fn listed_services(channel: Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("expected a service list");
    };
    list.service.into_iter().map(|s| s.name).collect()
}

#[tokio::test]
async fn reflection_lists_only_the_services_this_port_serves() {
    let s = Server::start(config()).await;
    let channel = Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut names = listed_services(channel).await;
    names.sort();
    assert_eq!(
        names,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "kvlease.v1.CacheService",
        ],
        "the scheduler's and the worker's services are not served here"
    );
    s.shutdown().await;
}

#[tokio::test]
async fn a_lease_at_a_completed_step_is_failed_precondition_and_stats_carry_the_curve() {
    let mut server = Server::start(config()).await;
    let c = &mut server.client;
    register(c, 16).await;
    let s = open(c).await;
    let tokens: Vec<u32> = (1..=9).collect();
    let out = c
        .lease(lease_req(s, 1, vec![seq(1, tokens.clone())]))
        .await
        .unwrap()
        .into_inner();
    grant(&out.outcomes[0]);
    c.complete_step(complete_req(s, 1)).await.unwrap();
    // A client that leaves step at 0 is told why its blocks would never be
    // published, and nothing is taken.
    assert_status(
        c.lease(lease_req(s, 0, vec![seq(2, tokens.clone())])).await,
        Code::FailedPrecondition,
        "already completed step 1",
    );
    let out = c
        .lease(lease_req(s, 2, vec![seq(2, tokens)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&out.outcomes[0]).reused_tokens, 8);
    let stats = c
        .get_stats(pb::GetStatsRequest {
            pool_group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let full = &stats.pools[0];
    let scales: Vec<f64> = full.hit_rate_estimates.iter().map(|e| e.scale).collect();
    assert_eq!(scales, vec![0.5, 1.0, 2.0, 4.0]);
    // Two leases looked up 2 blocks each; the second hit both, at any size.
    for e in &full.hit_rate_estimates {
        assert_eq!(e.sampled_lookups, 4, "{e:?}");
        assert!((e.hit_rate - 0.5).abs() < 1e-9, "{e:?}");
    }
    assert_eq!(full.hit_rate_estimates[3].blocks, 64);
    // the default, `adaptive`: it starts from `lru` and estimates every
    // candidate on the same sampled lookups
    assert_eq!(
        (full.eviction_policy.as_str(), full.current_policy.as_str()),
        ("adaptive", "lru")
    );
    let candidates: Vec<&str> = full
        .policy_estimates
        .iter()
        .map(|e| e.policy.as_str())
        .collect();
    assert_eq!(candidates, ["lru", "lfu", "chain"]);
    assert_eq!(full.policy_switches, 0);
    server.shutdown().await;
}

/// An item's `traceparent` is tracing only: a malformed one (or too few in
/// a Release) never fails the call or changes its answer.
#[tokio::test]
async fn malformed_item_trace_contexts_are_ignored() {
    let (mut s, sess) = Server::with_session(config(), 6).await;
    let c = &mut s.client;
    let mut spec = seq(1, (0..9).collect());
    spec.traceparent = "00-not-a-trace-context".into();
    let out = lease(c, sess, 1, vec![spec]).await;
    assert_eq!(grant(&out[0]).tables[0].block_ids.len(), 3);
    let item = pb::ExtendItem {
        seq_id: 1,
        new_tokens: vec![9],
        traceparent: "\u{0}garbage".into(),
        ..Default::default()
    };
    let request = extend_req(sess, 1, vec![item]);
    grant(&c.extend(request).await.unwrap().into_inner().outcomes[0]);
    let released = c
        .release(pb::ReleaseRequest {
            traceparents: vec!["01-zz".into()],
            ..release_req(sess, vec![1, 2], Some(1))
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(released.len(), 2);
    assert_eq!(released[0].status, pb::ReleaseStatus::Released as i32);
    assert_eq!(released[1].status, pb::ReleaseStatus::Unknown as i32);
}

/// A growth sent again from the length it already grew from (its first
/// answer lost) is refused LENGTH_MISMATCH over the wire, naming both
/// lengths, and takes nothing; from the right length it grows.
#[tokio::test]
async fn a_growth_retried_from_a_stale_length_is_length_mismatch() {
    let (mut s, sess) = Server::with_session(config(), 6).await;
    let c = &mut s.client;
    let out = lease(c, sess, 1, vec![seq(1, (0..8).collect())]).await;
    assert_eq!(grant(&out[0]).tables[0].block_ids.len(), 2);
    let from = |from_length, new_tokens| pb::ExtendItem {
        from_length,
        ..ext_item(1, new_tokens)
    };
    let grew = c
        .extend(extend_req(sess, 2, vec![from(8, vec![8, 9])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&grew.outcomes[0]).tables[0].block_ids.len(), 1);
    let before = stats(c).await.pools[0].in_use;
    let again = c
        .extend(extend_req(sess, 3, vec![from(8, vec![8, 9])]))
        .await
        .unwrap()
        .into_inner();
    let Some(pb::sequence_outcome::Outcome::Reject(r)) = &again.outcomes[0].outcome else {
        panic!("a retry of an applied growth is refused: {again:?}")
    };
    assert_eq!(r.reason, pb::RejectReason::LengthMismatch as i32);
    assert!(
        r.message.contains("10 tokens long") && r.message.contains("the 8"),
        "{}",
        r.message
    );
    assert_eq!(stats(c).await.pools[0].in_use, before, "nothing taken");
    let grew = c
        .extend(extend_req(sess, 3, vec![from(10, vec![10])]))
        .await
        .unwrap()
        .into_inner();
    grant(&grew.outcomes[0]);
    s.shutdown().await;
}

/// Issue 29, point 3: a RegisterPool past the principal's block limit is
/// RESOURCE_EXHAUSTED naming the figures, and registers nothing.
#[tokio::test]
async fn a_registration_over_the_principals_block_limit_is_resource_exhausted() {
    let mut s = Server::start(cache_svc::Config {
        max_blocks_per_principal: 100,
        ..config()
    })
    .await;
    let c = &mut s.client;
    c.register_pool(register_req("m/a", 4, vec![pool_spec(0, 64)]))
        .await
        .unwrap();
    assert_status(
        c.register_pool(register_req("m/b", 4, vec![pool_spec(0, 64)]))
            .await,
        Code::ResourceExhausted,
        "pool group \"m/b\" asks for 64 blocks; principal anonymous has 64 registered, 128 in all is over the limit of 100 blocks per principal (36 more fit)",
    );
    assert_eq!(stats(c).await.pools.len(), 1, "nothing of m/b registered");
    s.shutdown().await;
}

/// Issue 29, point 3: a large RegisterPool builds its pools outside the
/// cache's lock: another session's calls are answered while it builds,
/// each in a small part of the registration's time (with the build under
/// the lock, one waited for nearly all of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_calls_are_answered_while_a_large_pool_is_built() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
    let mut other = c.clone();
    let registering = tokio::spawn(async move {
        let started = Instant::now();
        let big = register_req("m/big", 16, vec![pool_spec(0, 1 << 21)]);
        other.register_pool(big).await.unwrap();
        started.elapsed()
    });
    let (mut calls, mut slowest) = (0, Duration::ZERO);
    while !registering.is_finished() {
        let started = Instant::now();
        c.keep_alive(keep_alive_req(sess)).await.unwrap();
        slowest = slowest.max(started.elapsed());
        calls += 1;
    }
    let took = registering.await.unwrap();
    assert!(calls > 1, "{calls} calls while it built in {took:?}");
    assert!(
        slowest < took / 4,
        "a keep-alive waited {slowest:?} of the registration's {took:?}"
    );
    s.shutdown().await;
}

/// Issue 29, point 9: WatchEvents streams are limited per principal as well
/// as in all; the refusal names the figures.
#[tokio::test]
async fn watch_streams_are_limited_per_principal() {
    let mut s = Server::start(cache_svc::Config {
        max_watch_streams: 4,
        max_watch_streams_per_principal: 2,
        ..config()
    })
    .await;
    let c = &mut s.client;
    let mut open = Vec::new();
    for _ in 0..2 {
        let stream = c
            .watch_events(pb::WatchEventsRequest { after_id: 0 })
            .await
            .unwrap();
        open.push(stream);
    }
    assert_status(
        c.watch_events(pb::WatchEventsRequest { after_id: 0 }).await,
        Code::ResourceExhausted,
        "principal anonymous has 2 WatchEvents streams open, the limit per principal is 2",
    );
    drop(open);
    s.shutdown().await;
}

/// `SequenceSpec.fork_of` over the wire: a branch shares its parent's full
/// blocks and gets a copy of the block of its last prompt token (counted in
/// `PoolStats.fork_shared` / `fork_copies`); a parent not held is a
/// per-sequence `UNKNOWN_SEQUENCE`; a malformed fork is `INVALID_ARGUMENT`
/// naming `fork_of`, nothing taken.
#[tokio::test]
async fn forks_share_blocks_and_malformed_forks_name_fork_of() {
    let (mut s, sess) = Server::with_session(config(), 16).await;
    let c = &mut s.client;
    let prompt: Vec<u32> = (0..10).collect();
    let fork = |seq_id: u64, parent: u64, tokens: Vec<u32>| pb::SequenceSpec {
        fork_of: Some(parent),
        ..seq(seq_id, tokens)
    };
    let parent = c
        .lease(lease_req(sess, 1, vec![seq(1, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    let parent = grant(&parent.outcomes[0]).clone();
    // its prompt pass completes: a branch shares only what a completed step wrote
    c.complete_step(complete_req(sess, 1)).await.unwrap();
    let in_use = |st: &pb::GetStatsResponse| st.pools.iter().map(|p| p.in_use).collect::<Vec<_>>();
    let before = stats(c).await;
    let mut beams = fork(2, 1, prompt.clone());
    beams.beam_width = 2;
    for (bad, why) in [
        (fork(1, 1, prompt.clone()), "cannot fork itself"),
        (beams, "beam_width must be 1"),
        (
            fork(2, 1, (5..15).collect()),
            "not the tokens the parent holds",
        ),
    ] {
        let status = c.lease(lease_req(sess, 2, vec![bad])).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        let message = status.message();
        assert!(
            message.contains("fork_of") && message.contains(why),
            "{message}"
        );
    }
    assert_eq!(in_use(&before), in_use(&stats(c).await), "nothing taken");
    let out = c
        .lease(lease_req(
            sess,
            2,
            vec![fork(2, 1, prompt.clone()), fork(3, 9, prompt.clone())],
        ))
        .await
        .unwrap()
        .into_inner();
    let g = grant(&out.outcomes[0]);
    assert_eq!(g.reused_tokens, 9);
    // both pools (full attention and window 8): blocks 0 and 1 shared
    // where the window reaches them, block 2 copied
    for t in &g.tables {
        let mother = parent
            .tables
            .iter()
            .find(|p| p.pool_id == t.pool_id)
            .unwrap();
        assert_eq!(t.first_block, mother.first_block);
        let shared = 2 - t.first_block as usize;
        assert_eq!(t.block_ids[..shared], mother.block_ids[..shared]);
        assert_ne!(t.block_ids[shared], mother.block_ids[shared]);
    }
    assert_eq!(g.copies.len(), 2);
    assert!(g.copies.iter().all(|c| c.tokens == 1));
    let r = reject(&out.outcomes[1]);
    assert_eq!(r.reason, pb::RejectReason::UnknownSequence as i32);
    let st = stats(c).await;
    assert_eq!(st.pools.iter().map(|p| p.fork_copies).sum::<u64>(), 2);
    assert!(st.pools.iter().map(|p| p.fork_shared).sum::<u64>() >= 2);
    s.shutdown().await;
}

/// Peer pull over gRPC: two groups under one peer key, a prefix published
/// in one is granted to the other as peer copies with the cost model's
/// figures; malformed peer fields are INVALID_ARGUMENT naming the field,
/// and a bad key registers nothing.
#[tokio::test]
async fn peer_pull_grants_copies_and_malformed_peer_fields_name_the_field() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    let peer_pool = || pb::PoolSpec {
        bytes_per_block: 4_096,
        ..pool_spec(0, 16)
    };
    let bad_key = pb::RegisterPoolRequest {
        peer_key: "bad key".into(),
        ..register_req("m/r1", 4, vec![peer_pool()])
    };
    assert_status(
        c.register_pool(bad_key).await,
        Code::InvalidArgument,
        "peer_key",
    );
    for group in ["m/r0", "m/r1"] {
        let req = pb::RegisterPoolRequest {
            peer_key: "seeded:f32".into(),
            ..register_req(group, 4, vec![peer_pool()])
        };
        let r = c.register_pool(req).await.unwrap().into_inner();
        assert!(
            !r.already_registered,
            "{group} was registered by the bad call"
        );
    }
    let sess = open(c).await;
    let prompt: Vec<u32> = (10..21).collect();
    let out = lease(c, sess, 1, vec![seq_in("m/r0", 1, prompt.clone())]).await;
    let source = grant(&out[0]).tables[0].block_ids.clone();
    c.complete_step(complete_req(sess, 1)).await.unwrap();
    let rates = pb::PeerPullRates {
        link_bytes_per_s: 1_000_000_000,
        prefill_tokens_per_s: 1_000,
        overhead_us: 100,
    };
    let pulling = pb::SequenceSpec {
        peer_pull: Some(rates),
        ..seq_in("m/r1", 2, prompt.clone())
    };
    let out = lease(c, sess, 2, vec![pulling]).await;
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 8);
    let srcs: Vec<u32> = g.peer_copies.iter().map(|p| p.src_block).collect();
    assert_eq!(srcs, source[..2].to_vec());
    assert!(g.peer_copies.iter().all(|p| p.src_group == "m/r0"));
    let d = g.peer_decision.as_ref().unwrap();
    assert_eq!((d.blocks, d.bytes, d.pulled), (2, 8_192, true));
    assert_eq!((d.pull_us, d.recompute_us), (109, 8_000));
    // Match counts what the pull would bring
    let m = c
        .r#match(pb::MatchRequest {
            session_id: sess.0,
            epoch: sess.1,
            pool_groups: vec!["m/r0".into(), "m/r1".into()],
            prompts: vec![pb::MatchPrompt {
                prompt_tokens: prompt.clone(),
                cache_salt: String::new(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    // sequence 2's step is not complete: its pulled blocks are not
    // published in m/r1 yet, so a lease there would pull them again
    assert_eq!(m.results[0].reused_tokens, vec![8, 0]);
    assert_eq!(m.results[0].peer_tokens, vec![0, 8]);
    for (field, bad) in [
        (
            "peer_pull.link_bytes_per_s",
            pb::PeerPullRates {
                link_bytes_per_s: 0,
                ..rates
            },
        ),
        (
            "peer_pull.prefill_tokens_per_s",
            pb::PeerPullRates {
                prefill_tokens_per_s: 0,
                ..rates
            },
        ),
    ] {
        let spec = pb::SequenceSpec {
            peer_pull: Some(bad),
            ..seq_in("m/r1", 3, prompt.clone())
        };
        assert_status(
            c.lease(lease_req(sess, 3, vec![spec])).await,
            Code::InvalidArgument,
            field,
        );
    }
    c.release(release_req(sess, vec![1, 2], Some(2)))
        .await
        .unwrap();
    c.complete_step(complete_req(sess, 3)).await.unwrap();
    let audit = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    for p in stats(c).await.pools {
        assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
    }
    s.shutdown().await;
}

/// A hand-off over gRPC (`SequenceSpec.handoff_of`, disaggregated
/// serving): a sequence prefilled in one group is leased in its peer group
/// with every prompt position pulled (the partly filled last block by its
/// leading slots, `PeerCopy.tokens`), the decision forced; a malformed
/// hand-off is INVALID_ARGUMENT naming `handoff_of`, nothing taken.
#[tokio::test]
async fn a_handoff_pulls_the_whole_prompt_and_malformed_handoffs_name_handoff_of() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    for group in ["m/p", "m/d"] {
        let req = pb::RegisterPoolRequest {
            peer_key: "seeded:f32".into(),
            ..register_req(
                group,
                4,
                vec![pb::PoolSpec {
                    bytes_per_block: 4_096,
                    ..pool_spec(0, 16)
                }],
            )
        };
        c.register_pool(req).await.unwrap();
    }
    let sess = open(c).await;
    let prompt: Vec<u32> = (10..20).collect();
    let out = lease(c, sess, 1, vec![seq_in("m/p", 1, prompt.clone())]).await;
    let source = grant(&out[0]).tables[0].block_ids.clone();
    c.complete_step(complete_req(sess, 1)).await.unwrap();
    let handoff = |seq_id: u64, of: u64, tokens: Vec<u32>| pb::SequenceSpec {
        handoff_of: Some(of),
        prefill_tokens: 1,
        ..seq_in("m/d", seq_id, tokens)
    };
    let mut next = prompt.clone();
    next.push(99);
    let before = stats(c).await;
    for (bad, why) in [
        (handoff(2, 2, next.clone()), "cannot hand itself off"),
        (
            handoff(2, 1, prompt.clone()),
            "the prompt must be its 10 tokens",
        ),
        (
            pb::SequenceSpec {
                pool_group: "m/p".into(),
                ..handoff(2, 1, next.clone())
            },
            "the lease's own group",
        ),
    ] {
        let status = c.lease(lease_req(sess, 2, vec![bad])).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        let message = status.message();
        assert!(
            message.contains("handoff_of") && message.contains(why),
            "{message}"
        );
    }
    let in_use = |st: &pb::GetStatsResponse| st.pools.iter().map(|p| p.in_use).collect::<Vec<_>>();
    assert_eq!(in_use(&before), in_use(&stats(c).await), "nothing taken");
    let out = lease(c, sess, 2, vec![handoff(2, 1, next)]).await;
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 10);
    let copies: Vec<(u32, u32)> = g
        .peer_copies
        .iter()
        .map(|p| (p.src_block, p.tokens))
        .collect();
    assert_eq!(copies, vec![(source[0], 0), (source[1], 0), (source[2], 2)]);
    let d = g.peer_decision.as_ref().unwrap();
    assert!(d.forced && d.pulled, "{d:?}");
    c.release(release_req(sess, vec![1], Some(2)))
        .await
        .unwrap();
    c.complete_step(complete_req(sess, 2)).await.unwrap();
    c.release(release_req(sess, vec![2], None)).await.unwrap();
    let audit = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    let st = stats(c).await;
    for p in &st.pools {
        assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
    }
    let handed: Vec<(String, u64)> = st
        .pools
        .iter()
        .map(|p| (p.pool_group.clone(), p.handoff_blocks))
        .collect();
    assert!(handed.contains(&("m/d".into(), 3)), "{handed:?}");
    s.shutdown().await;
}
