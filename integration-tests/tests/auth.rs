//! The trust boundary, end to end over mTLS: the authorization matrix (every RPC of every
//! service x every role -> expected status), and the attacks of issue 13 that must now fail:
//! a hostile principal's Forward over another tenant's blocks, the use of another
//! principal's cache session, probing another tenant's prefixes, and a second scheduler
//! principal leasing, matching or registering in the first one's pool groups.

use std::time::Duration;

use kvlease_auth::matrix::MATRIX;
use kvlease_integration_tests::secure::{SecureCluster, channel_as, security_args};
use kvlease_integration_tests::{Generated, collect, small_worker, start_scheduler, start_worker};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use tonic::Code;
use tonic::transport::Channel;

/// How long a scheduler started here may take to serve.
const WITHIN: Duration = Duration::from_secs(60);

fn config() -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context: 256,
        max_tokens: 200,
        max_seqs: 8,
        max_tokens_per_step: 192,
        ..scheduler_svc::Config::default()
    }
}

/// The callers of the matrix: a certificate's principal, or none.
const CALLERS: [Option<&str>; 6] = [
    Some("scheduler"), // role scheduler, and the owner of the worker
    Some("alice"),     // client
    Some("watcher"),   // observer
    Some("ops"),       // admin
    Some("nobody"),    // no role
    None,              // no certificate
];

/// What each caller of [`CALLERS`] gets, per RPC, written out independently of the matrix
/// module: `A` allowed (any status but PERMISSION_DENIED/UNAUTHENTICATED: empty messages may
/// well be invalid), `D` PERMISSION_DENIED for a missing role, `O` PERMISSION_DENIED by the
/// worker's owner check, `U` UNAUTHENTICATED.
const EXPECTED: &[(&str, &str)] = &[
    ("/kvlease.v1.CacheService/RegisterPool", "ADDADU"),
    ("/kvlease.v1.CacheService/OpenSession", "ADDADU"),
    ("/kvlease.v1.CacheService/KeepAlive", "ADDADU"),
    ("/kvlease.v1.CacheService/CloseSession", "ADDADU"),
    ("/kvlease.v1.CacheService/Lease", "ADDADU"),
    ("/kvlease.v1.CacheService/Extend", "ADDADU"),
    ("/kvlease.v1.CacheService/Release", "ADDADU"),
    ("/kvlease.v1.CacheService/CompleteStep", "ADDADU"),
    ("/kvlease.v1.CacheService/Step", "ADDADU"),
    ("/kvlease.v1.CacheService/Estimate", "ADAADU"),
    ("/kvlease.v1.CacheService/GetStats", "ADAADU"),
    ("/kvlease.v1.CacheService/WatchEvents", "ADAADU"),
    ("/kvlease.v1.CacheService/Audit", "DDDADU"),
    ("/kvlease.v1.CacheService/UnregisterPool", "DDDADU"),
    ("/kvlease.v1.CacheService/Match", "ADDADU"),
    ("/kvlease.v1.Scheduler/Generate", "DADADU"),
    ("/kvlease.v1.Scheduler/GetStatus", "DAAADU"),
    ("/kvlease.v1.WorkerService/Describe", "ADAADU"),
    ("/kvlease.v1.WorkerService/Forward", "ADDODU"),
    ("/kvlease.v1.WorkerService/GetTokenizer", "AAAADU"),
    ("/kvlease.v1.WorkerService/PullBlocks", "AOOOOU"),
    ("/grpc.health.v1.Health/Check", "AAAAAU"),
    ("/grpc.health.v1.Health/Watch", "AAAAAU"),
    (
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "AAAAAU",
    ),
    (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "AAAAAU",
    ),
];

/// Calls `path` with an empty message (every message's fields have defaults) and returns the
/// status it got: OK once the response headers say so (a stream may then run on).
async fn call(channel: Channel, path: &str) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(channel);
    if let Err(e) = grpc.ready().await {
        return tonic::Status::unavailable(e.to_string());
    }
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let Ok(path) = http::uri::PathAndQuery::try_from(path) else {
        return tonic::Status::internal("bad path");
    };
    let call = grpc.server_streaming(tonic::Request::new(()), path, codec);
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(_)) => tonic::Status::ok(""),
        Ok(Err(status)) => status,
        Err(_) => tonic::Status::deadline_exceeded("no answer in 10 s"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_matrix_every_rpc_by_every_role() -> Result<(), Box<dyn std::error::Error>> {
    let cluster = SecureCluster::start(config()).await?;
    // The table above names every RPC the matrix has, and only those.
    let mut listed: Vec<String> = MATRIX.iter().map(|(s, m, _)| format!("/{s}/{m}")).collect();
    let mut expected: Vec<String> = EXPECTED.iter().map(|(p, _)| p.to_string()).collect();
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected);

    let mut checked = 0;
    for (path, row) in EXPECTED {
        let servers = if path.starts_with("/kvlease.v1.CacheService/") {
            vec![cluster.cache.addr]
        } else if path.starts_with("/kvlease.v1.Scheduler/") {
            vec![cluster.scheduler.addr]
        } else if path.starts_with("/kvlease.v1.WorkerService/") {
            vec![cluster.worker.addr]
        } else {
            vec![
                cluster.cache.addr,
                cluster.scheduler.addr,
                cluster.worker.addr,
            ]
        };
        for addr in servers {
            for (caller, want) in CALLERS.iter().zip(row.chars()) {
                let status = call(channel_as(addr, *caller).await?, path).await;
                let who = caller.unwrap_or("(no certificate)");
                let got = (status.code(), status.message());
                match want {
                    'A' => assert!(
                        !matches!(
                            status.code(),
                            Code::PermissionDenied | Code::Unauthenticated
                        ),
                        "{path} by {who}: want allowed, got {got:?}"
                    ),
                    'D' => assert!(
                        status.code() == Code::PermissionDenied
                            && status.message().contains("needs role")
                            && status.message().contains(&format!("principal {who} ")),
                        "{path} by {who}: want PERMISSION_DENIED naming the role, got {got:?}"
                    ),
                    'O' => assert!(
                        status.code() == Code::PermissionDenied
                            && status.message().contains("serves only its owner scheduler"),
                        "{path} by {who}: want PERMISSION_DENIED by the owner check, got {got:?}"
                    ),
                    'U' => assert!(
                        status.code() == Code::Unauthenticated
                            && status.message().contains("no client certificate"),
                        "{path} by {who}: want UNAUTHENTICATED, got {got:?}"
                    ),
                    other => panic!("bad expectation {other}"),
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, (21 + 4 * 3) * CALLERS.len());
    cluster.stop().await?;
    Ok(())
}

fn greedy(prompt: &[u32]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens: prompt.to_vec(),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    }
}

async fn generate_as(
    cluster: &SecureCluster,
    who: &str,
    prompt: &[u32],
) -> Result<Generated, Box<dyn std::error::Error>> {
    let mut client = SchedulerClient::new(channel_as(cluster.scheduler.addr, Some(who)).await?);
    let g = collect(&mut client, greedy(prompt)).await?;
    assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{g:?}");
    Ok(g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_principal_cannot_write_over_another_tenants_blocks()
-> Result<(), Box<dyn std::error::Error>> {
    let cluster = SecureCluster::start(config()).await?;
    // four full blocks of 16 tokens, then one more token
    let prompt: Vec<u32> = (0..65).map(|i| 3 + (i * 7) % 200).collect();
    let first = generate_as(&cluster, "alice", &prompt).await?;

    // The attack of issue 13: Forward garbage over every block id of both pools. A second
    // scheduler (role scheduler, not the worker's owner) and a client are refused.
    let describe = WorkerServiceClient::new(channel_as(cluster.worker.addr, Some("ops")).await?)
        .describe(pb::DescribeRequest {})
        .await?
        .into_inner();
    let tables: Vec<pb::BlockTable> = describe
        .pools
        .iter()
        .map(|p| pb::BlockTable {
            window: p.window,
            block_ids: (0..p.num_blocks.min(5)).collect(),
            ..Default::default()
        })
        .collect();
    assert!(!tables.is_empty());
    let poison = pb::ForwardRequest {
        after_step: 0,
        tier_copies: Vec::new(),
        step: 1 << 40,
        sequences: vec![pb::ForwardSequence {
            seq_id: 1 << 50,
            tokens: vec![199; 64],
            start_pos: 0,
            tables,
            ..Default::default()
        }],
    };
    for hostile in ["mallory", "alice"] {
        let mut worker =
            WorkerServiceClient::new(channel_as(cluster.worker.addr, Some(hostile)).await?);
        let err = worker.forward(poison.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{hostile}: {err:?}");
    }

    // The victim's greedy output is unchanged, and came from the cached prefix the attack
    // aimed at.
    let again = generate_as(&cluster, "alice", &prompt).await?;
    assert_eq!(again.tokens, first.tokens);
    assert!(again.reused_tokens >= 64, "{again:?}");
    // Another tenant sending the same prompt reuses nothing: it cannot probe alice's prefixes.
    let bob = generate_as(&cluster, "bob", &prompt).await?;
    assert_eq!(bob.reused_tokens, 0, "{bob:?}");
    assert_eq!(bob.tokens, first.tokens);
    cluster.stop().await?;
    Ok(())
}

/// A cache session of mallory's own (role scheduler).
async fn open_as_mallory(
    cache: &mut CacheServiceClient<Channel>,
) -> Result<pb::OpenSessionResponse, tonic::Status> {
    let opened = cache
        .open_session(pb::OpenSessionRequest {
            holder: "mallory".into(),
            ..Default::default()
        })
        .await?;
    Ok(opened.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_principals_cache_session_cannot_be_used_or_seen()
-> Result<(), Box<dyn std::error::Error>> {
    let cluster = SecureCluster::start(config()).await?;
    let status_as = |who: &'static str| {
        let addr = cluster.scheduler.addr;
        async move {
            let mut c = SchedulerClient::new(channel_as(addr, Some(who)).await?);
            Ok::<_, Box<dyn std::error::Error>>(
                c.get_status(pb::GetStatusRequest {}).await?.into_inner(),
            )
        }
    };
    let seen = status_as("alice").await?;
    assert_eq!(
        (seen.session_id, seen.epoch),
        (0, 0),
        "a client sees no session"
    );
    let admin = status_as("ops").await?;
    assert_ne!(admin.session_id, 0);

    // mallory holds the scheduler role and knows the id (say, leaked): still refused.
    let mut cache = CacheServiceClient::new(channel_as(cluster.cache.addr, Some("mallory")).await?);
    let (session_id, epoch) = (admin.session_id, admin.epoch);
    let denied = |r: Result<_, tonic::Status>| match r {
        Err(s) if s.code() == Code::PermissionDenied => {
            assert!(
                s.message().contains("belongs to another principal"),
                "{s:?}"
            );
        }
        other => panic!("want PERMISSION_DENIED, got {other:?}"),
    };
    denied(
        cache
            .keep_alive(pb::KeepAliveRequest { session_id, epoch })
            .await
            .map(|_| ()),
    );
    denied(
        cache
            .release(pb::ReleaseRequest {
                session_id,
                epoch,
                seq_ids: vec![1, 2, 3],
                ..Default::default()
            })
            .await
            .map(|_| ()),
    );
    denied(
        cache
            .close_session(pb::CloseSessionRequest { session_id, epoch })
            .await
            .map(|_| ()),
    );
    // mallory's own session works; its id is not the next one after the scheduler's
    let own = open_as_mallory(&mut cache).await?;
    assert_ne!(own.session_id, session_id + 1);
    cache
        .keep_alive(pb::KeepAliveRequest {
            session_id: own.session_id,
            epoch: own.epoch,
        })
        .await?;
    // the scheduler still serves
    let g = generate_as(&cluster, "alice", &[5, 6, 7]).await?;
    assert_eq!(g.tokens.len(), 8);
    cluster.stop().await?;
    Ok(())
}

/// Two scheduler principals on one cache (invariant 11): `mallory` (role scheduler, its own
/// session) asking for the pool group `scheduler` registered gets PERMISSION_DENIED naming
/// it, for Lease (of a prompt alice has cached there), Match and RegisterPool; a scheduler
/// of its own, with a worker it owns, fails its start-up on that group's name with the same
/// message. (Serving beside the first one with a prefix of its own would take a server
/// certificate for `mallory`; `kvlease_integration_tests::secure` issues
/// principals client certificates only. Two schedulers with their own groups on one cache
/// are `several_schedulers.rs`, as one principal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_scheduler_principal_cannot_use_the_first_ones_pool_groups()
-> Result<(), Box<dyn std::error::Error>> {
    let cluster = SecureCluster::start(config()).await?;
    let prompt: Vec<u32> = (0..65).map(|i| 3 + (i * 11) % 200).collect();
    generate_as(&cluster, "alice", &prompt).await?;
    let mut ops = CacheServiceClient::new(channel_as(cluster.cache.addr, Some("ops")).await?);
    let stats = ops
        .get_stats(pb::GetStatsRequest::default())
        .await?
        .into_inner();
    let first = stats
        .pools
        .first()
        .ok_or("the scheduler registered no pool")?;
    let group = first.pool_group.clone();
    let geometry = pb::RegisterPoolRequest {
        pool_group: group.clone(),
        tokens_per_block: first.tokens_per_block.into(),
        pools: stats
            .pools
            .iter()
            .filter(|p| p.pool_group == group)
            .map(|p| pb::PoolSpec {
                window: p.window.into(),
                num_blocks: p.total.into(),
                host_blocks: p.host_total.into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };

    let mut cache = CacheServiceClient::new(channel_as(cluster.cache.addr, Some("mallory")).await?);
    let own = open_as_mallory(&mut cache).await?;
    let named =
        format!("pool group {group:?} belongs to another principal; mallory may not use it");
    let denied = |r: Result<(), tonic::Status>, rpc: &str| match r {
        Err(s) if s.code() == Code::PermissionDenied => {
            assert!(s.message().contains(&named), "{rpc}: {s:?}");
        }
        other => panic!("{rpc}: want PERMISSION_DENIED, got {other:?}"),
    };
    let lease = cache
        .lease(pb::LeaseRequest {
            session_id: own.session_id,
            epoch: own.epoch,
            step: 1,
            sequences: vec![pb::SequenceSpec {
                seq_id: 1,
                pool_group: group.clone(),
                prompt_tokens: prompt.clone(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await;
    denied(lease.map(drop), "Lease");
    let matched = cache
        .r#match(pb::MatchRequest {
            session_id: own.session_id,
            epoch: own.epoch,
            pool_groups: vec![group.clone()],
            prompts: vec![pb::MatchPrompt {
                prompt_tokens: prompt.clone(),
                cache_salt: String::new(),
            }],
        })
        .await;
    denied(matched.map(drop), "Match");
    denied(
        cache.register_pool(geometry).await.map(drop),
        "RegisterPool",
    );

    // mallory's own scheduler and worker on the same cache
    let worker = start_worker(worker_svc::Config {
        security: security_args("worker"),
        owner: Some("mallory".into()),
        ..small_worker()
    })
    .await?;
    let second = scheduler_svc::Config {
        security: security_args("mallory"),
        holder: "mallory".into(),
        ..config()
    };
    let refused = start_scheduler(second, &cluster.cache.url(), &[worker.url()], WITHIN).await;
    match refused {
        Err(e) => assert!(e.to_string().contains(&named), "{e}"),
        Ok(s) => {
            s.stop().await?;
            panic!("a scheduler started on another principal's pool group");
        }
    }
    // the first scheduler still serves alice from her cached prefix
    let again = generate_as(&cluster, "alice", &prompt).await?;
    assert!(again.reused_tokens >= 64, "{again:?}");
    worker.stop().await?;
    cluster.stop().await?;
    Ok(())
}
