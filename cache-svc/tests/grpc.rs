//! The cache service over real gRPC on 127.0.0.1:0: every RPC, malformed
//! requests, unknown sessions, stale epochs, double release, limits, health,
//! reflection, and session expiry under paused time.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;

struct Server {
    client: CacheServiceClient<Channel>,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), cache_svc::Error>>>,
}

impl Server {
    async fn start(config: cache_svc::Config) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(cache_svc::run(listener, config, async {
            let _ = stopped.await;
        }));
        let client = CacheServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            client,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }
}

fn config() -> cache_svc::Config {
    cache_svc::Config {
        max_batch: 8,
        ..cache_svc::Config::default()
    }
}

const GROUP: &str = "m/r0";

async fn register(c: &mut CacheServiceClient<Channel>, blocks: u32) -> Vec<pb::PoolInfo> {
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: GROUP.into(),
        tokens_per_block: 4,
        pools: vec![
            pb::PoolSpec {
                host_blocks: 0,
                window: 0,
                num_blocks: blocks.into(),
            },
            pb::PoolSpec {
                host_blocks: 0,
                window: 8,
                num_blocks: blocks.into(),
            },
        ],
    })
    .await
    .unwrap()
    .into_inner()
    .pools
}

async fn open(c: &mut CacheServiceClient<Channel>) -> (u64, u64) {
    let r = open_session(c).await;
    (r.session_id, r.epoch)
}

async fn open_session(c: &mut CacheServiceClient<Channel>) -> pb::OpenSessionResponse {
    c.open_session(pb::OpenSessionRequest {
        holder: "test".into(),
        ttl_ms: 0,
    })
    .await
    .unwrap()
    .into_inner()
}

fn seq(seq_id: u64, tokens: Vec<u32>) -> pb::SequenceSpec {
    pb::SequenceSpec {
        seq_id,
        pool_group: GROUP.into(),
        prompt_tokens: tokens,
        ..Default::default()
    }
}

fn lease_req(s: (u64, u64), step: u64, sequences: Vec<pb::SequenceSpec>) -> pb::LeaseRequest {
    pb::LeaseRequest {
        session_id: s.0,
        epoch: s.1,
        step,
        atomic: false,
        sequences,
        warmup: false,
    }
}

fn grant(o: &pb::SequenceOutcome) -> &pb::Grant {
    match &o.outcome {
        Some(pb::sequence_outcome::Outcome::Grant(g)) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn reject(o: &pb::SequenceOutcome) -> &pb::Reject {
    match &o.outcome {
        Some(pb::sequence_outcome::Outcome::Reject(r)) => r,
        other => panic!("expected a reject, got {other:?}"),
    }
}

fn assert_status<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, needle: &str) {
    let status = r.expect_err("expected an error status");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "{:?} does not mention {needle:?}",
        status.message()
    );
}

#[tokio::test]
async fn register_pool_is_idempotent_and_validated() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    let first = register(c, 16).await;
    assert_eq!(first.len(), 2);
    let again = c
        .register_pool(pb::RegisterPoolRequest {
            pool_group: GROUP.into(),
            tokens_per_block: 4,
            pools: vec![
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 8,
                    num_blocks: 16,
                },
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 0,
                    num_blocks: 16,
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(again.already_registered);
    assert_eq!(again.pools[1].pool_id, first[0].pool_id);
    let conflict = c
        .register_pool(pb::RegisterPoolRequest {
            pool_group: GROUP.into(),
            tokens_per_block: 8,
            pools: vec![pb::PoolSpec {
                host_blocks: 0,
                window: 0,
                num_blocks: 16,
            }],
        })
        .await;
    assert_status(conflict, Code::AlreadyExists, "another geometry");
    let bad = c
        .register_pool(pb::RegisterPoolRequest {
            pool_group: "x".into(),
            tokens_per_block: 0,
            pools: vec![pb::PoolSpec {
                host_blocks: 0,
                window: 0,
                num_blocks: 16,
            }],
        })
        .await;
    assert_status(bad, Code::InvalidArgument, "tokens_per_block");
    let dup = c
        .register_pool(pb::RegisterPoolRequest {
            pool_group: "x".into(),
            tokens_per_block: 4,
            pools: vec![
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 0,
                    num_blocks: 16,
                },
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 0,
                    num_blocks: 8,
                },
            ],
        })
        .await;
    assert_status(dup, Code::InvalidArgument, "listed twice");
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
    c.keep_alive(pb::KeepAliveRequest {
        session_id: id,
        epoch,
    })
    .await
    .unwrap();
    assert_status(
        c.keep_alive(pb::KeepAliveRequest {
            session_id: id + 100,
            epoch,
        })
        .await,
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
        .close_session(pb::CloseSessionRequest {
            session_id: id,
            epoch,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(closed.sequences_released, 1);
    assert_eq!(closed.blocks_returned, 4, "two blocks in each pool");
    assert_status(
        c.keep_alive(pb::KeepAliveRequest {
            session_id: id,
            epoch,
        })
        .await,
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
        .extend(pb::ExtendRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 2,
            atomic: false,
            items: vec![
                pb::ExtendItem {
                    seq_id: 1,
                    new_tokens: vec![9, 10, 11, 12],
                    num_tokens: 0,
                    traceparent: String::new(),
                    written_tokens: 0,
                },
                pb::ExtendItem {
                    seq_id: 77,
                    new_tokens: vec![],
                    num_tokens: 1,
                    traceparent: String::new(),
                    written_tokens: 0,
                },
            ],
        })
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
        .complete_step(pb::CompleteStepRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 2,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.blocks_returned, 0);

    let rel = c
        .release(pb::ReleaseRequest {
            session_id: sess.0,
            epoch: sess.1,
            seq_ids: vec![1],
            fence_step: Some(3),
            traceparents: Vec::new(),
            discard_unwritten: false,
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(rel[0].status(), pb::ReleaseStatus::Released);
    assert!(rel[0].blocks_fenced > 0);
    let twice = c
        .release(pb::ReleaseRequest {
            session_id: sess.0,
            epoch: sess.1,
            seq_ids: vec![1, 5],
            fence_step: None,
            traceparents: Vec::new(),
            discard_unwritten: false,
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(twice[0].status(), pb::ReleaseStatus::AlreadyReleased);
    assert_eq!(twice[0].blocks_freed, 0);
    assert_eq!(twice[1].status(), pb::ReleaseStatus::Unknown);

    let stats = c
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
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
        .complete_step(pb::CompleteStepRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 3,
        })
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
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
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
    let mut group = seq(1, vec![1]);
    group.pool_group = "other".into();
    assert_status(
        c.lease(lease_req(sess, 1, vec![group])).await,
        Code::NotFound,
        "unknown pool group",
    );
    let many: Vec<_> = (0..9).map(|i| seq(i, vec![1])).collect();
    assert_status(
        c.lease(lease_req(sess, 1, many)).await,
        Code::ResourceExhausted,
        "batch limit is 8",
    );
    assert_status(
        c.extend(pb::ExtendRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 1,
            atomic: false,
            items: vec![pb::ExtendItem {
                seq_id: 1,
                new_tokens: vec![],
                num_tokens: 0,
                traceparent: String::new(),
                written_tokens: 0,
            }],
        })
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
    let stats = c
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(stats.pools.iter().all(|p| p.free == p.total));
    s.shutdown().await;
}

#[tokio::test]
async fn oversized_message_is_resource_exhausted() {
    let mut s = Server::start(cache_svc::Config {
        max_message_bytes: 4096,
        ..config()
    })
    .await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
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
    let release = |seq_ids: Vec<u64>| pb::ReleaseRequest {
        session_id: sess.0,
        epoch: sess.1,
        seq_ids,
        ..Default::default()
    };
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
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
    let mut stream = c
        .watch_events(pb::WatchEventsRequest { after_id: 0 })
        .await
        .unwrap()
        .into_inner();
    c.lease(lease_req(sess, 1, vec![seq(1, (0..9).collect())]))
        .await
        .unwrap();
    c.complete_step(pb::CompleteStepRequest {
        session_id: sess.0,
        epoch: sess.1,
        step: 1,
    })
    .await
    .unwrap();
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
    let mut s = Server::start(cache_svc::Config {
        session_ttl_ms: 2_000,
        ..config()
    })
    .await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
    c.lease(lease_req(
        sess,
        1,
        vec![seq(1, (0..9).collect()), seq(2, (50..59).collect())],
    ))
    .await
    .unwrap();
    c.release(pb::ReleaseRequest {
        session_id: sess.0,
        epoch: sess.1,
        seq_ids: vec![2],
        fence_step: Some(1),
        traceparents: Vec::new(),
        discard_unwritten: false,
    })
    .await
    .unwrap();
    tokio::time::advance(Duration::from_secs(3)).await;
    // Let the housekeeping task run its expiry tick.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let stats = c
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.sessions, 0);
    for p in &stats.pools {
        assert_eq!((p.in_use, p.fenced, p.free), (0, 0, p.total), "{p:?}");
    }
    assert_status(
        c.keep_alive(pb::KeepAliveRequest {
            session_id: sess.0,
            epoch: sess.1,
        })
        .await,
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
    c.complete_step(pb::CompleteStepRequest {
        session_id: s.0,
        epoch: s.1,
        step: 1,
    })
    .await
    .unwrap();
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
    server.shutdown().await;
}

/// An item's `traceparent` is tracing only: a malformed one (or too few in
/// a Release) never fails the call or changes its answer.
#[tokio::test]
async fn malformed_item_trace_contexts_are_ignored() {
    let mut s = Server::start(config()).await;
    register(&mut s.client, 6).await;
    let sess = open(&mut s.client).await;
    let c = &mut s.client;
    let mut spec = seq(1, (0..9).collect());
    spec.traceparent = "00-not-a-trace-context".into();
    let out = c
        .lease(lease_req(sess, 1, vec![spec]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    assert_eq!(grant(&out[0]).tables[0].block_ids.len(), 3);
    let item = pb::ExtendItem {
        seq_id: 1,
        new_tokens: vec![9],
        traceparent: "\u{0}garbage".into(),
        ..Default::default()
    };
    let request = pb::ExtendRequest {
        session_id: sess.0,
        epoch: sess.1,
        step: 1,
        items: vec![item],
        ..Default::default()
    };
    grant(&c.extend(request).await.unwrap().into_inner().outcomes[0]);
    let released = c
        .release(pb::ReleaseRequest {
            session_id: sess.0,
            epoch: sess.1,
            seq_ids: vec![1, 2],
            fence_step: Some(1),
            traceparents: vec!["01-zz".into()],
            discard_unwritten: false,
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(released.len(), 2);
    assert_eq!(released[0].status, pb::ReleaseStatus::Released as i32);
    assert_eq!(released[1].status, pb::ReleaseStatus::Unknown as i32);
}

fn ext_item(seq_id: u64, new_tokens: Vec<u32>) -> pb::ExtendItem {
    pb::ExtendItem {
        seq_id,
        new_tokens,
        num_tokens: 0,
        traceparent: String::new(),
        written_tokens: 0,
    }
}

/// `Step` applies its release, then its completion, then its extends, under
/// one lock: a full pool's extend is granted from the blocks the release and
/// the completion of the same call returned.
#[tokio::test]
async fn step_applies_release_then_complete_then_extend() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 6).await;
    let sess = open(c).await;
    // two sequences of 12 tokens fill the full-attention pool (3 + 3 blocks)
    let out = c
        .lease(lease_req(
            sess,
            1,
            vec![seq(1, (0..12).collect()), seq(2, (100..112).collect())],
        ))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    grant(&out[0]);
    grant(&out[1]);
    let r = c
        .step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(pb::StepRelease {
                seq_ids: vec![1],
                fence_step: Some(1),
                traceparents: Vec::new(),
                discard_unwritten: false,
            }),
            complete_step: Some(1),
            extend: Some(pb::StepExtend {
                step: 2,
                atomic: false,
                items: vec![ext_item(2, vec![112])],
            }),
        })
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
    let out = c
        .lease(lease_req(sess, 2, vec![seq(3, (200..208).collect())]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    grant(&out[0]);
    let r = c
        .step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: None,
            complete_step: None,
            extend: Some(pb::StepExtend {
                step: 3,
                atomic: false,
                items: vec![ext_item(3, (208..213).collect())],
            }),
        })
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
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
    let out = c
        .lease(lease_req(sess, 1, vec![seq(1, (0..8).collect())]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    grant(&out[0]);
    let release_1 = || pb::StepRelease {
        seq_ids: vec![1],
        fence_step: None,
        traceparents: Vec::new(),
        discard_unwritten: false,
    };
    let mut both = ext_item(1, vec![8]);
    both.num_tokens = 2;
    assert_status(
        c.step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(release_1()),
            complete_step: Some(1),
            extend: Some(pb::StepExtend {
                step: 2,
                atomic: false,
                items: vec![both],
            }),
        })
        .await,
        Code::InvalidArgument,
        "only one of",
    );
    assert_status(
        c.step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(pb::StepRelease {
                seq_ids: (0..9).collect(),
                fence_step: None,
                traceparents: Vec::new(),
                discard_unwritten: false,
            }),
            complete_step: None,
            extend: None,
        })
        .await,
        Code::ResourceExhausted,
        "batch limit is 8",
    );
    assert_status(
        c.step(pb::StepRequest {
            session_id: sess.0 + 1000,
            epoch: sess.1,
            release: Some(release_1()),
            complete_step: None,
            extend: None,
        })
        .await,
        Code::FailedPrecondition,
        "unknown session",
    );
    // sequence 1 is still held: the refused calls released nothing
    let stats = c
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(stats.pools.iter().any(|p| p.in_use > 0), "{stats:?}");
    let rel = c
        .step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(release_1()),
            complete_step: None,
            extend: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rel.release.unwrap().results[0].status(),
        pb::ReleaseStatus::Released
    );
    s.shutdown().await;
}

fn progress_item(seq_id: u64, written_tokens: u32) -> pb::ExtendItem {
    pb::ExtendItem {
        seq_id,
        written_tokens,
        ..Default::default()
    }
}

/// Chunked prefill: `prefill_tokens` past the prompt and `written_tokens`
/// past the sequence are INVALID_ARGUMENT naming both figures (a `Step`
/// carrying such an item applies none of its parts); a progress report in a
/// `Step` publishes the held-back blocks it covers at the step's completion.
#[tokio::test]
async fn chunked_prefill_figures_are_checked_and_progress_publishes() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
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
    let out = c
        .lease(lease_req(sess, 1, vec![first]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    assert_eq!(grant(&out[0]).reused_tokens, 0);
    assert_status(
        c.extend(pb::ExtendRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 1,
            atomic: false,
            items: vec![progress_item(1, 17)],
        })
        .await,
        Code::InvalidArgument,
        "written_tokens 17 is beyond its length of 16 tokens",
    );
    // The same inside Step: its release of the sequence is not applied.
    assert_status(
        c.step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(pb::StepRelease {
                seq_ids: vec![1],
                fence_step: None,
                traceparents: Vec::new(),
                discard_unwritten: false,
            }),
            complete_step: None,
            extend: Some(pb::StepExtend {
                step: 1,
                atomic: false,
                items: vec![progress_item(1, 17)],
            }),
        })
        .await,
        Code::InvalidArgument,
        "written_tokens 17 is beyond its length of 16 tokens",
    );
    // Step 1 wrote the first block only; step 2 writes through token 12.
    let r = c
        .step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: None,
            complete_step: Some(1),
            extend: Some(pb::StepExtend {
                step: 2,
                atomic: false,
                items: vec![progress_item(1, 12)],
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let progress = r.extend.expect("an extend part");
    assert!(grant(&progress.outcomes[0]).tables.is_empty());
    let reused = |out: &[pb::SequenceOutcome]| grant(&out[0]).reused_tokens;
    let out = c
        .lease(lease_req(sess, 2, vec![seq(2, prompt.clone())]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    assert_eq!(reused(&out), 4, "blocks of later chunks are not reused");
    let r = c
        .step(pb::StepRequest {
            session_id: sess.0,
            epoch: sess.1,
            release: Some(pb::StepRelease {
                seq_ids: vec![2],
                fence_step: None,
                traceparents: Vec::new(),
                discard_unwritten: false,
            }),
            complete_step: Some(2),
            extend: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.complete.is_some());
    let out = c
        .lease(lease_req(sess, 3, vec![seq(3, prompt)]))
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    assert_eq!(reused(&out), 12, "the reported blocks publish");
    s.shutdown().await;
}

/// A release after a failed forward pass (`discard_unwritten`), through
/// `Release` and through `Step`: the blocks stay fenced until the step
/// completes, and then nothing they hold is reused; the same fenced release
/// without the flag publishes at completion, as before.
#[tokio::test]
async fn a_release_after_a_failed_pass_publishes_nothing() {
    let mut s = Server::start(config()).await;
    let c = &mut s.client;
    register(c, 16).await;
    let sess = open(c).await;
    let reused = |out: &[pb::SequenceOutcome]| grant(&out[0]).reused_tokens;
    let lease = async |c: &mut CacheServiceClient<Channel>, step, seq_id, tokens| {
        c.lease(lease_req(sess, step, vec![seq(seq_id, tokens)]))
            .await
            .unwrap()
            .into_inner()
            .outcomes
    };
    let step_release = |seq_id, step, discard_unwritten| pb::StepRequest {
        session_id: sess.0,
        epoch: sess.1,
        release: Some(pb::StepRelease {
            seq_ids: vec![seq_id],
            fence_step: Some(step),
            traceparents: Vec::new(),
            discard_unwritten,
        }),
        complete_step: Some(step),
        extend: None,
    };

    // Release, then CompleteStep
    lease(c, 1, 1, (0..9).collect()).await;
    let released = c
        .release(pb::ReleaseRequest {
            session_id: sess.0,
            epoch: sess.1,
            seq_ids: vec![1],
            fence_step: Some(1),
            traceparents: Vec::new(),
            discard_unwritten: true,
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(released[0].status(), pb::ReleaseStatus::Released);
    assert!(released[0].blocks_fenced > 0, "{released:?}");
    assert_eq!(released[0].blocks_freed, 0, "{released:?}");
    let complete = c
        .complete_step(pb::CompleteStepRequest {
            session_id: sess.0,
            epoch: sess.1,
            step: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        complete.blocks_returned,
        u64::from(released[0].blocks_fenced)
    );
    let out = lease(c, 2, 2, (0..10).collect()).await;
    assert_eq!(reused(&out), 0, "through Release");

    // one Step: the release with the flag, then the completion
    lease(c, 3, 3, (100..109).collect()).await;
    let r = c.step(step_release(3, 3, true)).await.unwrap().into_inner();
    let release = r.release.expect("a release part");
    assert!(release.results[0].blocks_fenced > 0, "{release:?}");
    let out = lease(c, 4, 4, (100..110).collect()).await;
    assert_eq!(reused(&out), 0, "through Step");

    // the same Step without the flag publishes what step 5 wrote
    lease(c, 5, 5, (200..209).collect()).await;
    c.step(step_release(5, 5, false)).await.unwrap();
    let out = lease(c, 6, 6, (200..210).collect()).await;
    assert!(reused(&out) >= 8, "{out:?}");

    let audit = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    s.shutdown().await;
}

// === ownership of pool groups, between principals ===

/// Bearer tokens of the ownership test: two schedulers and an operator.
const TOKENS: &[(&str, &str, &str)] = &[
    ("token-of-scheduler-a", "sched-a", "scheduler"),
    ("token-of-scheduler-b", "sched-b", "scheduler"),
    ("token-of-the-operator", "ops", "admin"),
];

/// Adds one principal's bearer token to every call.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        r.metadata_mut().insert("authorization", self.0.clone());
        Ok(r)
    }
}

type Authed = CacheServiceClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// A client of the server at `addr` calling as principal `name` of [`TOKENS`].
async fn client_as(addr: std::net::SocketAddr, name: &str) -> Authed {
    let token = TOKENS.iter().find(|t| t.1 == name).unwrap().0;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let bearer = Bearer(format!("Bearer {token}").parse().unwrap());
    CacheServiceClient::with_interceptor(channel, bearer)
}

fn register_req(group: &str) -> pb::RegisterPoolRequest {
    pb::RegisterPoolRequest {
        pool_group: group.into(),
        tokens_per_block: 4,
        pools: vec![pb::PoolSpec {
            host_blocks: 0,
            window: 0,
            num_blocks: 8,
        }],
    }
}

async fn open_as(c: &mut Authed, holder: &str) -> (u64, u64) {
    let r = c
        .open_session(pb::OpenSessionRequest {
            holder: holder.into(),
            ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    (r.session_id, r.epoch)
}

fn seq_in(group: &str, seq_id: u64, tokens: Vec<u32>) -> pb::SequenceSpec {
    pb::SequenceSpec {
        pool_group: group.into(),
        ..seq(seq_id, tokens)
    }
}

/// A session of one principal leases, matches and registers only in its
/// principal's groups (invariant 11): scheduler B (and an operator's own
/// session) asking for scheduler A's group gets PERMISSION_DENIED naming it,
/// with nothing taken and nothing learnt of A's cached prefix.
#[tokio::test]
async fn a_principals_session_may_use_only_its_principals_groups() {
    let dir = std::env::temp_dir().join(format!("kvlease-cache-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("tokens");
    let lines: Vec<String> = TOKENS
        .iter()
        .map(|(t, n, r)| format!("{t} {n} {r}"))
        .collect();
    std::fs::write(&token_file, lines.join("\n")).unwrap();
    let mut config = config();
    config.security.token_file = Some(token_file);
    let server = Server::start(config).await;
    let (mut a, mut b) = (
        client_as(server.addr, "sched-a").await,
        client_as(server.addr, "sched-b").await,
    );
    let mut ops = client_as(server.addr, "ops").await;

    // A's group with a cached prefix of two full blocks
    a.register_pool(register_req("m/a")).await.unwrap();
    let sa = open_as(&mut a, "a").await;
    let prompt: Vec<u32> = (40..49).collect();
    let out = a
        .lease(lease_req(sa, 1, vec![seq_in("m/a", 1, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    grant(&out.outcomes[0]);
    a.complete_step(pb::CompleteStepRequest {
        session_id: sa.0,
        epoch: sa.1,
        step: 1,
    })
    .await
    .unwrap();
    a.release(pb::ReleaseRequest {
        session_id: sa.0,
        epoch: sa.1,
        seq_ids: vec![1],
        ..Default::default()
    })
    .await
    .unwrap();

    b.register_pool(register_req("m/b")).await.unwrap();
    let sb = open_as(&mut b, "b").await;
    let so = open_as(&mut ops, "ops").await;
    let before = ops
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let denied = "belongs to another principal";
    // B's Lease, a member of its own group first; the operator's session
    // (no group of its own) gets no override
    for (c, s, who, own) in [
        (&mut b, sb, "sched-b", Some("m/b")),
        (&mut ops, so, "ops", None),
    ] {
        let mut specs: Vec<_> = own
            .map(|g| seq_in(g, 7, prompt.clone()))
            .into_iter()
            .collect();
        specs.push(seq_in("m/a", 8, prompt.clone()));
        for atomic in [false, true] {
            let r = c
                .lease(pb::LeaseRequest {
                    atomic,
                    ..lease_req(s, 1, specs.clone())
                })
                .await;
            assert_status(
                r,
                Code::PermissionDenied,
                "pool group \"m/a\" belongs to another principal",
            );
        }
        let r = c
            .r#match(pb::MatchRequest {
                session_id: s.0,
                epoch: s.1,
                pool_groups: vec!["m/a".into()],
                prompts: vec![pb::MatchPrompt {
                    prompt_tokens: prompt.clone(),
                    cache_salt: String::new(),
                }],
            })
            .await;
        assert_status(r, Code::PermissionDenied, "pool group \"m/a\"");
        // registering A's group again, with its geometry or another
        let mut other = register_req("m/a");
        other.pools[0].num_blocks = 9;
        for req in [register_req("m/a"), other] {
            let r = c.register_pool(req).await;
            assert_status(
                r,
                Code::PermissionDenied,
                &format!("\"m/a\" {denied}; {who} may not use it"),
            );
        }
    }
    let after = ops
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before, after, "a refused call took or counted something");
    assert!(after.pools.iter().all(|p| p.in_use == 0 && p.fenced == 0));
    assert_eq!(after.sequences, 0);

    // A still leases in its group, reusing its prefix; B in its own
    let out = a
        .lease(lease_req(sa, 2, vec![seq_in("m/a", 8, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&out.outcomes[0]).reused_tokens, 8);
    let out = b
        .lease(lease_req(sb, 1, vec![seq_in("m/b", 7, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&out.outcomes[0]).reused_tokens, 0);
    let again = a.register_pool(register_req("m/a")).await.unwrap();
    assert!(again.into_inner().already_registered);
    for (c, s) in [(&mut a, sa), (&mut b, sb), (&mut ops, so)] {
        c.close_session(pb::CloseSessionRequest {
            session_id: s.0,
            epoch: s.1,
        })
        .await
        .unwrap();
    }
    let audit = ops
        .audit(pb::AuditRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
