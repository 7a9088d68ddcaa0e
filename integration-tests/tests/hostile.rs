//! A hostile client against real services: every input fault and every
//! resource a caller can grow (issue 13, the limits half). Each case asserts
//! the status and its message, then that the service still answers, its
//! pools are whole and the leak audit reclaims nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, SmallCluster, assert_cache_sound, cache_client, collect, scheduler_client, small_worker,
    start_cache, start_worker,
};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

// === raw messages a well-behaved client could not build ===

/// Field 1 as raw bytes: invalid UTF-8 where the service has a string.
#[derive(Clone, PartialEq, prost::Message)]
struct RawField1 {
    #[prost(bytes = "vec", tag = "1")]
    bytes: Vec<u8>,
}

/// Field 2 with the wrong wire type (fixed64 where a varint is expected).
#[derive(Clone, PartialEq, prost::Message)]
struct WrongWireType {
    #[prost(fixed64, tag = "2")]
    value: u64,
}

/// `GenerateRequest` with its 32-bit numbers sent 64 bits wide, as any
/// client can.
#[derive(Clone, PartialEq, prost::Message)]
struct WideGenerate {
    #[prost(uint64, repeated, tag = "2")]
    tokens: Vec<u64>,
    #[prost(uint64, tag = "3")]
    max_tokens: u64,
}

/// An unknown field padding a message past the size limit.
#[derive(Clone, PartialEq, prost::Message)]
struct Padded {
    #[prost(bytes = "vec", tag = "99")]
    pad: Vec<u8>,
}

/// A unary call of `path` with any message.
async fn raw_unary<M, R>(addr: SocketAddr, path: &'static str, message: M) -> Result<R, Status>
where
    M: prost::Message + Send + Sync + 'static,
    R: prost::Message + Default + Send + Sync + 'static,
{
    let channel = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| Status::internal(e.to_string()))?
        .connect()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<M, R>::default();
    grpc.unary(
        tonic::Request::new(message),
        http::uri::PathAndQuery::from_static(path),
        codec,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// A server-streaming call of `path` with any message, to its first answer.
async fn raw_stream<M>(addr: SocketAddr, path: &'static str, message: M) -> Result<(), Status>
where
    M: prost::Message + Send + Sync + 'static,
{
    let channel = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| Status::internal(e.to_string()))?
        .connect()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<M, pb::GenerateResponse>::default();
    let mut stream = grpc
        .server_streaming(
            tonic::Request::new(message),
            http::uri::PathAndQuery::from_static(path),
            codec,
        )
        .await?
        .into_inner();
    stream.message().await.map(drop)
}

#[track_caller]
fn assert_status<T: std::fmt::Debug>(r: Result<T, Status>, code: Code, needles: &[&str]) {
    let status = r.expect_err("the call should have been refused");
    assert_eq!(status.code(), code, "{status:?}");
    for n in needles {
        assert!(
            status.message().contains(n),
            "{n:?} not in {:?}",
            status.message()
        );
    }
}

async fn register(
    c: &mut CacheServiceClient<Channel>,
    group: &str,
    blocks: u64,
) -> Result<(), Status> {
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: group.into(),
        tokens_per_block: 16,
        pools: vec![pb::PoolSpec {
            host_blocks: 0,
            window: 0,
            num_blocks: blocks,
            ..Default::default()
        }],
        ..Default::default()
    })
    .await
    .map(drop)
}

async fn open(c: &mut CacheServiceClient<Channel>, holder: &str) -> Result<(u64, u64), Status> {
    let r = c
        .open_session(pb::OpenSessionRequest {
            holder: holder.into(),
            ttl_ms: 0,
        })
        .await?
        .into_inner();
    Ok((r.session_id, r.epoch))
}

fn seq(seq_id: u64, group: &str, tokens: u32) -> pb::SequenceSpec {
    pb::SequenceSpec {
        seq_id,
        pool_group: group.into(),
        num_tokens: tokens,
        ..Default::default()
    }
}

// === the cache ===

#[tokio::test]
async fn the_cache_refuses_every_input_fault_with_the_documented_status() {
    let cache = start_cache(cache_svc::Config {
        max_message_bytes: 64 << 10,
        max_sessions_per_holder: 3,
        max_pool_groups: 3,
        // `lru`, 96 bytes a block: 1 MiB holds 10922 blocks (the default,
        // `adaptive`, counts two filters of at least 256 KiB a pool)
        eviction_policy: cache_svc::eviction::PolicyKind::Lru,
        pool_memory_budget_mib: 1,
        max_watch_streams: 2,
        session_quota: 8,
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    let addr = cache.addr;
    let mut c = cache_client(addr).await.unwrap();
    register(&mut c, "g", 64).await.unwrap();

    // undecodable: a wrong wire type, and invalid UTF-8 in a string
    assert_status(
        raw_unary::<_, pb::OpenSessionResponse>(
            addr,
            "/kvlease.v1.CacheService/OpenSession",
            WrongWireType { value: 7 },
        )
        .await,
        Code::InvalidArgument,
        &["failed to decode", "wire type"],
    );
    assert_status(
        raw_unary::<_, pb::OpenSessionResponse>(
            addr,
            "/kvlease.v1.CacheService/OpenSession",
            RawField1 {
                bytes: vec![b'h', 0xff, 0xfe],
            },
        )
        .await,
        Code::InvalidArgument,
        &["failed to decode", "UTF-8"],
    );
    // over the documented message limit
    assert_status(
        raw_unary::<_, pb::LeaseResponse>(
            addr,
            "/kvlease.v1.CacheService/Lease",
            Padded {
                pad: vec![0; 100 << 10],
            },
        )
        .await,
        Code::ResourceExhausted,
        &["message length too large", "the limit is: 65536 bytes"],
    );
    // a number its 32-bit value would have truncated (2^40 + 5 became 5)
    assert_status(
        register(&mut c, "big", (1 << 40) + 5).await,
        Code::InvalidArgument,
        &["num_blocks is 1099511627781"],
    );
    // names that would forge log lines
    assert_status(
        register(&mut c, "g\nFORGED level=ERROR", 4).await,
        Code::InvalidArgument,
        &["pool_group may only hold", "'\\n'"],
    );
    assert_status(
        open(&mut c, "h\r\nx").await,
        Code::InvalidArgument,
        &["holder may only hold"],
    );

    // sessions per holder
    let (sid, epoch) = open(&mut c, "h").await.unwrap();
    open(&mut c, "h").await.unwrap();
    open(&mut c, "h").await.unwrap();
    assert_status(
        open(&mut c, "h").await,
        Code::ResourceExhausted,
        &["has 3 sessions open", "limit per holder is 3"],
    );

    // the memory budget, then the group limit
    assert_status(
        register(&mut c, "huge", 20_000).await,
        Code::ResourceExhausted,
        &[
            "asks for 20000 blocks",
            "over the budget of 1048576 bytes",
            "10858 more blocks fit",
        ],
    );
    register(&mut c, "g2", 8).await.unwrap();
    register(&mut c, "g3", 8).await.unwrap();
    assert_status(
        register(&mut c, "g4", 8).await,
        Code::ResourceExhausted,
        &["3 pool groups are registered, the limit is 3"],
    );

    // UnregisterPool: malformed, unknown, busy, then done
    let uc = c.clone();
    let unregister = |group: &str| {
        let mut c = uc.clone();
        let group = group.to_owned();
        async move {
            c.unregister_pool(pb::UnregisterPoolRequest { pool_group: group })
                .await
                .map(tonic::Response::into_inner)
        }
    };
    assert_status(
        unregister("").await,
        Code::InvalidArgument,
        &["pool_group must be 1 to 128"],
    );
    assert_status(
        unregister("nope").await,
        Code::NotFound,
        &["unknown pool group \"nope\""],
    );
    let leased = c
        .lease(pb::LeaseRequest {
            session_id: sid,
            epoch,
            step: 1,
            sequences: vec![seq(1, "g3", 20)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(
        leased.outcomes[0].outcome,
        Some(pb::sequence_outcome::Outcome::Grant(_))
    ));
    assert_status(
        unregister("g3").await,
        Code::FailedPrecondition,
        &["still in use", "2 blocks in use and 0 fenced"],
    );

    // QUOTA_EXCEEDED carries its figures (quota 8, 2 held, 16 asked)
    let quota = c
        .lease(pb::LeaseRequest {
            session_id: sid,
            epoch,
            step: 1,
            sequences: vec![seq(2, "g", 256)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(pb::sequence_outcome::Outcome::Reject(r)) = &quota.outcomes[0].outcome else {
        panic!("{quota:?}");
    };
    assert_eq!(r.reason(), pb::RejectReason::QuotaExceeded);
    assert_eq!((r.blocks_needed, r.blocks_free), (16, 6), "{r:?}");

    // CompleteStep(u64::MAX) frees what is fenced instead of overflowing
    let released = c
        .release(pb::ReleaseRequest {
            session_id: sid,
            epoch,
            seq_ids: vec![1],
            fence_step: Some(5),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(released.results[0].blocks_fenced, 2);
    let done = c
        .complete_step(pb::CompleteStepRequest {
            session_id: sid,
            epoch,
            step: u64::MAX,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.blocks_returned, 2);
    let gone = unregister("g3").await.unwrap();
    assert_eq!((gone.pools_removed, gone.blocks_removed), (1, 8));
    register(&mut c, "g4", 8).await.unwrap();

    // WatchEvents: after_id beyond the newest event, and the stream cap
    for after_id in [u64::MAX, 1_000_000_000] {
        assert_status(
            c.watch_events(pb::WatchEventsRequest { after_id }).await,
            Code::OutOfRange,
            &["beyond the newest event", "resume from 0"],
        );
    }
    let w1 = c
        .watch_events(pb::WatchEventsRequest { after_id: 0 })
        .await
        .unwrap();
    let w2 = c
        .watch_events(pb::WatchEventsRequest { after_id: 0 })
        .await
        .unwrap();
    assert_status(
        c.watch_events(pb::WatchEventsRequest { after_id: 0 }).await,
        Code::ResourceExhausted,
        &["2 WatchEvents streams are open, the limit is 2"],
    );
    drop((w1, w2));
    // a slot comes back once its stream is gone
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match c.watch_events(pb::WatchEventsRequest { after_id: 0 }).await {
            Ok(_) => break,
            Err(s)
                if s.code() == Code::ResourceExhausted
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(s) => panic!("{s:?}"),
        }
    }

    for group in ["g", "g2", "g4"] {
        assert_cache_sound(addr, group, Duration::from_secs(10))
            .await
            .unwrap();
    }
    cache.stop().await.unwrap();
}

#[tokio::test]
async fn idle_connections_do_not_lock_real_clients_out() {
    let cache = start_cache(cache_svc::Config {
        limits: kvlease_runtime::limits::ServeLimits {
            max_connections: 64,
            max_pending_handshakes: 16,
            handshake_timeout_ms: 60_000,
            ..Default::default()
        },
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    let addr = cache.addr;
    // far more silent sockets than the service has slots for
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // a real client still gets through at once (it evicts a silent one)
    let answered = tokio::time::timeout(Duration::from_secs(5), async {
        let mut c = cache_client(addr).await?;
        c.get_stats(pb::GetStatsRequest::default()).await?;
        Ok::<_, kvlease_integration_tests::Error>(())
    })
    .await;
    assert!(matches!(answered, Ok(Ok(()))), "{answered:?}");
    // and the silent ones were closed, all but the newest few
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        // the server wrote its HTTP/2 settings first: read past them to the
        // end (closed) or to nothing more yet (open)
        let mut closed = 0;
        for s in &idle {
            let mut buf = [0u8; 256];
            loop {
                match s.try_read(&mut buf) {
                    Ok(0) => closed += 1,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => closed += 1,
                }
                break;
            }
        }
        if closed >= 300 - 16 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {closed} of 300 idle sockets were closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(idle);
    cache.stop().await.unwrap();
}

// === the scheduler and the worker ===

#[tokio::test]
async fn the_scheduler_and_the_worker_refuse_faults_and_a_starved_request_gets_an_answer() {
    let cluster = SmallCluster::start(scheduler_svc::Config {
        max_message_bytes: 64 << 10,
        max_tokens: 64,
        max_context: 256,
        max_queue: 2,
        max_queue_wait_ms: 1_500,
        ..scheduler_svc::Config::default()
    })
    .await
    .unwrap();
    let sched = cluster.scheduler.addr;
    let generate = "/kvlease.v1.Scheduler/Generate";
    assert_status(
        raw_stream(
            sched,
            generate,
            RawField1 {
                bytes: vec![0xc3, 0x28],
            },
        )
        .await,
        Code::InvalidArgument,
        &["failed to decode", "UTF-8"],
    );
    assert_status(
        raw_stream(
            sched,
            generate,
            Padded {
                pad: vec![1; 100 << 10],
            },
        )
        .await,
        Code::ResourceExhausted,
        &["the limit is: 65536 bytes"],
    );
    // prost alone truncates a uint32: 2^32 + 4 tokens were served as 4
    assert_status(
        raw_stream(
            sched,
            generate,
            WideGenerate {
                tokens: vec![1, 2, 3],
                max_tokens: (1 << 32) + 4,
            },
        )
        .await,
        Code::InvalidArgument,
        &["GenerateRequest.max_tokens is 4294967300, over its 32-bit limit of 4294967295"],
    );
    assert_status(
        raw_unary::<_, pb::ForwardResponse>(
            cluster.worker.addr,
            "/kvlease.v1.WorkerService/Forward",
            Padded {
                pad: vec![1; 17 << 20],
            },
        )
        .await,
        Code::ResourceExhausted,
        &["the limit is: 16777216 bytes"],
    );

    // starvation: another session leases every block of the scheduler's group
    let cache = cluster.cache.addr;
    let mut c = cache_client(cache).await.unwrap();
    let (sid, epoch) = open(&mut c, "hostile").await.unwrap();
    let mut held = 0;
    for id in 1..=200 {
        let r = c
            .lease(pb::LeaseRequest {
                session_id: sid,
                epoch,
                step: 1,
                sequences: vec![seq(id, GROUP, 16)],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        match r.outcomes[0].outcome {
            Some(pb::sequence_outcome::Outcome::Grant(_)) => held += 1,
            _ => break,
        }
    }
    assert!(held > 0);
    let request = pb::GenerateRequest {
        tokens: vec![1, 2, 3, 4, 5],
        max_tokens: 4,
        ..Default::default()
    };
    let mut waiting = Vec::new();
    for _ in 0..2 {
        let mut client = scheduler_client(sched).await.unwrap();
        let r = request.clone();
        waiting.push(tokio::spawn(async move { collect(&mut client, r).await }));
    }
    // the queue (2) is full: the next Generate is refused at once
    let mut client = scheduler_client(sched).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let full = loop {
        match collect(&mut client, request.clone()).await {
            Err(s) => break s,
            Ok(g) if tokio::time::Instant::now() > deadline => panic!("never refused: {g:?}"),
            Ok(_) => {}
        }
    };
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    assert!(full.message().contains("the limit is 2"), "{full:?}");
    // the waiting ones end REJECTED QUEUE_TIMEOUT with figures, no hang
    for w in waiting {
        let g = tokio::time::timeout(Duration::from_secs(20), w)
            .await
            .expect("a starved request hung")
            .unwrap()
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Rejected, "{g:?}");
        let r = g.reject.unwrap();
        assert_eq!(r.reason(), pb::RejectReason::QueueTimeout, "{r:?}");
        assert!(r.message.contains("the limit is 1500 ms"), "{}", r.message);
        assert!(
            r.message.contains("POOL_EXHAUSTED") || r.message.contains("pool exhausted"),
            "{}",
            r.message
        );
        assert!(r.blocks_needed > 0 && r.pool_id > 0, "{r:?}");
    }
    c.close_session(pb::CloseSessionRequest {
        session_id: sid,
        epoch,
    })
    .await
    .unwrap();
    // once the hog is gone, the same request is served
    let g = collect(&mut client, request).await.unwrap();
    assert!(
        matches!(
            g.finish_reason(),
            pb::FinishReason::Length | pb::FinishReason::Stop
        ),
        "{g:?}"
    );
    assert_cache_sound(cache, GROUP, Duration::from_secs(10))
        .await
        .unwrap();
    cluster.stop().await.unwrap();
}

#[tokio::test]
async fn a_worker_alone_refuses_undecodable_forwards() {
    let worker = start_worker(small_worker()).await.unwrap();
    assert_status(
        raw_unary::<_, pb::ForwardResponse>(
            worker.addr,
            "/kvlease.v1.WorkerService/Forward",
            WrongWireType { value: 1 },
        )
        .await,
        Code::InvalidArgument,
        &["failed to decode"],
    );
    // still up
    kvlease_integration_tests::worker_client(worker.addr)
        .await
        .unwrap()
        .describe(pb::DescribeRequest::default())
        .await
        .unwrap();
    worker.stop().await.unwrap();
}

/// Issue 29, point 3, as the attacker tried it: while one principal
/// registers a pool group of 2^21 blocks, another session's keep-alives are
/// answered all along, each in a small part of the registration's time (when
/// the pools were built under the cache's lock, a keep-alive waited for
/// nearly all of it and a real scheduler's session expired), and a group
/// past the principal's block cap is RESOURCE_EXHAUSTED with the figures,
/// leaving nothing registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_registration_neither_stalls_other_sessions_nor_passes_the_principals_cap() {
    let cache = start_cache(cache_svc::Config {
        max_blocks_per_principal: (1 << 21) + 64,
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    let mut c = cache_client(cache.addr).await.unwrap();
    register(&mut c, "g", 64).await.unwrap();
    let (session_id, epoch) = open(&mut c, "scheduler").await.unwrap();
    let mut attacker = c.clone();
    let registering = tokio::spawn(async move {
        let started = std::time::Instant::now();
        register(&mut attacker, "huge", 1 << 21)
            .await
            .map(|()| started.elapsed())
    });
    let (mut calls, mut slowest) = (0, Duration::ZERO);
    while !registering.is_finished() {
        let started = std::time::Instant::now();
        let r = c
            .keep_alive(pb::KeepAliveRequest { session_id, epoch })
            .await;
        assert!(
            r.is_ok(),
            "a keep-alive failed while a pool was registered: {r:?}"
        );
        slowest = slowest.max(started.elapsed());
        calls += 1;
    }
    let took = registering.await.unwrap().unwrap();
    assert!(
        calls > 1,
        "{calls} keep-alive(s) while the group registered in {took:?}"
    );
    assert!(
        slowest < took / 4,
        "a keep-alive waited {slowest:?} of the registration's {took:?}"
    );
    assert_status(
        register(&mut c, "over", 1).await,
        Code::ResourceExhausted,
        &["over the limit", "blocks per principal"],
    );
    let pools = c
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .pools;
    assert!(
        pools.iter().all(|p| p.pool_group != "over"),
        "a refused registration left pools"
    );
}

// === echoes ===

/// What a call answered with a megabyte in one of its strings: whatever it
/// refused, its message is short and the status says what was wrong (an echo
/// of the megabyte broke the reply: "h2 protocol error", RESOURCE_EXHAUSTED).
#[track_caller]
fn short_answer(what: &str, answer: Result<String, Status>) {
    let (code, message) = match answer {
        Ok(message) => (Code::Ok, message),
        Err(s) => (s.code(), s.message().to_string()),
    };
    let head = &message[..message.len().min(300)];
    assert!(
        message.len() < 1024,
        "{what}: a {} byte message: {head}",
        message.len()
    );
    assert!(
        !matches!(
            code,
            Code::ResourceExhausted | Code::Internal | Code::Unknown | Code::Unavailable
        ),
        "{what}: {code:?} {head}"
    );
}

/// A unary call's answer as [`short_answer`] reads it.
fn unary<T>(r: Result<tonic::Response<T>, Status>) -> Result<String, Status> {
    r.map(|_| String::new())
}

/// Issue 29, point 9: a 1 MB string in any field a caller fills is never
/// named back whole, by the cache or the scheduler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_in_a_string_field_is_never_echoed() {
    let cluster = SmallCluster::start(scheduler_svc::Config {
        max_tokens: 8,
        max_context: 256,
        ..scheduler_svc::Config::default()
    })
    .await
    .unwrap();
    let huge = "(".repeat(1 << 20);
    // the cache
    let mut c = cache_client(cluster.cache.addr).await.unwrap();
    let (session_id, epoch) = open(&mut c, "echo").await.unwrap();
    let answers = [
        (
            "OpenSession.holder",
            open(&mut c, &huge).await.map(|_| String::new()),
        ),
        (
            "RegisterPool.pool_group",
            register(&mut c, &huge, 4).await.map(|()| String::new()),
        ),
        (
            "UnregisterPool.pool_group",
            unary(
                c.unregister_pool(pb::UnregisterPoolRequest {
                    pool_group: huge.clone(),
                })
                .await,
            ),
        ),
        (
            "GetStats.pool_group",
            unary(
                c.get_stats(pb::GetStatsRequest {
                    pool_group: huge.clone(),
                })
                .await,
            ),
        ),
        (
            "Match.pool_groups",
            unary(
                c.r#match(pb::MatchRequest {
                    session_id,
                    epoch,
                    pool_groups: vec![huge.clone()],
                    prompts: vec![pb::MatchPrompt {
                        prompt_tokens: vec![1, 2, 3],
                        cache_salt: huge.clone(),
                    }],
                })
                .await,
            ),
        ),
    ];
    for (what, answer) in answers {
        short_answer(what, answer);
    }
    let lease_with = |edit: &dyn Fn(&mut pb::SequenceSpec)| {
        let mut s = seq(1, GROUP, 4);
        edit(&mut s);
        let mut c = c.clone();
        async move {
            c.lease(pb::LeaseRequest {
                session_id,
                epoch,
                step: 1,
                sequences: vec![s],
                ..Default::default()
            })
            .await
            .map(|r| format!("{:?}", r.into_inner().outcomes))
        }
    };
    short_answer(
        "Lease pool_group",
        lease_with(&|s| s.pool_group = huge.clone()).await,
    );
    short_answer(
        "Lease traceparent",
        lease_with(&|s| s.traceparent = huge.clone()).await,
    );
    // the scheduler
    let mut s = scheduler_client(cluster.scheduler.addr).await.unwrap();
    let generate = |r: pb::GenerateRequest| {
        let mut s = s.clone();
        async move { collect(&mut s, r).await.map(|g| g.message) }
    };
    let text = |t: &str| pb::GenerateRequest {
        text: t.into(),
        max_tokens: 2,
        ..Default::default()
    };
    let regex = |r: &str| pb::GenerateRequest {
        grammar: Some(pb::Grammar {
            kind: Some(pb::grammar::Kind::Regex(r.into())),
        }),
        ..text("x")
    };
    let cases = [
        ("text", text(&huge[..200_000])),
        (
            "request_id",
            pb::GenerateRequest {
                request_id: huge.clone(),
                ..text("x")
            },
        ),
        (
            "cache_salt",
            pb::GenerateRequest {
                cache_salt: huge.clone(),
                ..text("x")
            },
        ),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec![huge.clone()],
                ..text("x")
            },
        ),
        (
            "messages.role",
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage {
                    role: huge.clone(),
                    content: "x".into(),
                }],
                ..text("")
            },
        ),
        ("grammar.regex of 1 MB", regex(&huge)),
        // under the size limit, and no regex
        ("grammar.regex of 200 KB", regex(&huge[..200_000])),
    ];
    for (what, request) in cases {
        short_answer(what, generate(request).await);
    }
    s.get_status(pb::GetStatusRequest::default()).await.unwrap();
    cluster.stop().await.unwrap();
}
