//! `cargo bench -p cache-svc`: the cache's own speed, printed as one table.
//!
//! 1. In-process block allocations + frees per second on one core (the pool
//!    alone, and the whole lease/release path of the core).
//! 2. A 256-sequence `Extend` batch over gRPC on loopback, an empty unary RPC
//!    (gRPC health `Check`) on the same server, and their ratio; plaintext, then
//!    mTLS (certificates made in-process), and how much TLS moves the ratio.
//!
//! Figures from one run are only comparable with each other: the machines
//! are shared and noisy.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the bench

use std::hint::black_box;
use std::time::{Duration, Instant};

use cache_svc::cache::{Batch, Cache, CacheConfig};
use cache_svc::lease::{ExtendItem, Growth, Prompt, SeqSpec};
use cache_svc::pool::{BlockPool, Holder};
use cache_svc::{SeqId, SessionId, Step};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;

fn pool_alloc_free(seconds: f64) -> f64 {
    let mut pool = BlockPool::new(4096);
    let holder = Holder {
        session: SessionId(1),
        seq: SeqId(1),
    };
    let mut held = Vec::with_capacity(1024);
    let mut pairs = 0u64;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds {
        for _ in 0..64 {
            for _ in 0..1024 {
                if let Some(b) = pool.allocate(holder, 35) {
                    held.push(b);
                }
            }
            for b in held.drain(..) {
                pool.release(black_box(b), false);
            }
            pairs += 1024;
        }
    }
    pairs as f64 / start.elapsed().as_secs_f64()
}

fn lease_release_blocks(seconds: f64) -> f64 {
    let mut cache = Cache::with_epoch(CacheConfig::default(), cache_svc::Epoch(1));
    cache
        .register_pool("g", 16, &[(0, 65_536)])
        .expect("register");
    let now = Instant::now();
    let s = cache.open_session("bench", None, now).expect("session");
    let specs: Vec<SeqSpec> = (0..256)
        .map(|i| SeqSpec::new(SeqId(i), "g", Prompt::Count(16 * 16)))
        .collect();
    let ids: Vec<SeqId> = (0..256).map(SeqId).collect();
    let mut blocks = 0u64;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds {
        let out = cache
            .lease(s.session_id, s.epoch, Batch::default(), &specs, now)
            .expect("lease");
        black_box(&out);
        cache
            .release(s.session_id, s.epoch, &ids, None, now)
            .expect("release");
        blocks += 256 * 16;
    }
    blocks as f64 / start.elapsed().as_secs_f64()
}

/// The core's share of a 256-sequence Extend: the same shapes as the gRPC
/// measurement, without the transport.
fn core_extend_256(iterations: u32) -> Duration {
    let mut cache = Cache::with_epoch(CacheConfig::default(), cache_svc::Epoch(1));
    cache
        .register_pool("g", 16, &[(0, 65_536), (256, 65_536)])
        .expect("register");
    let now = Instant::now();
    let s = cache.open_session("bench", None, now).expect("session");
    let specs: Vec<SeqSpec> = (0..256u64)
        .map(|i| {
            SeqSpec::new(
                SeqId(i),
                "g",
                Prompt::Tokens((0..128).map(|t| (i as u32) * 1000 + t).collect()),
            )
        })
        .collect();
    cache
        .lease(s.session_id, s.epoch, Batch::default(), &specs, now)
        .expect("lease");
    let mut total = Duration::ZERO;
    for step in 1..=u64::from(iterations) {
        // the items as the gRPC service hands them over
        let items: Vec<ExtendItem> = (0..256u64)
            .map(|i| ExtendItem::grow(SeqId(i), Growth::Tokens(vec![(step as u32) ^ (i as u32)])))
            .collect();
        let batch = Batch {
            step: Step(step),
            ..Batch::default()
        };
        let t = Instant::now();
        let out = cache
            .extend_items(s.session_id, s.epoch, batch, &items, now)
            .expect("extend");
        total += t.elapsed();
        black_box(out);
        cache
            .complete_step(s.session_id, s.epoch, Step(step), now)
            .expect("complete");
    }
    total / iterations
}

/// Certificates for the mTLS run, in a fresh directory.
fn certs() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvlease-cache-bench-{}", std::process::id()));
    kvlease_auth::certs::write_dir(&dir, &[], &[]).expect("certificates");
    dir
}

/// The mean Extend(256) and empty unary call times, over mTLS when `tls` names the
/// certificates' directory.
async fn grpc(iterations: u32, tls: Option<&std::path::Path>) -> (Duration, Duration) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (args, client_security) = match tls {
        None => (
            kvlease_auth::SecurityArgs::default(),
            kvlease_auth::Security::loopback(),
        ),
        Some(dir) => {
            let read = |f: &str| std::fs::read(dir.join(f)).expect("read certificate");
            let args = kvlease_auth::SecurityArgs {
                tls_cert: Some(dir.join("cache.pem")),
                tls_key: Some(dir.join("cache.key")),
                tls_ca: Some(dir.join("ca.pem")),
                ..Default::default()
            };
            // the scheduler's identity: the role the Extend path needs
            let client = kvlease_auth::Security::tls(kvlease_auth::TlsMaterial {
                cert_pem: read("scheduler.pem"),
                key_pem: read("scheduler.key"),
                ca_pem: read("ca.pem"),
            });
            (args, client)
        }
    };
    let server = tokio::spawn(cache_svc::run(
        listener,
        cache_svc::Config {
            security: args,
            ..cache_svc::Config::default()
        },
        async {
            let _ = stopped.await;
        },
    ));
    let channel = client_security
        .endpoint(&addr.to_string(), Some(kvlease_auth::ServiceKind::Cache))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut client = CacheServiceClient::new(channel.clone());
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    client
        .register_pool(pb::RegisterPoolRequest {
            pool_group: "g".into(),
            tokens_per_block: 16,
            pools: vec![
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 0,
                    num_blocks: 65_536,
                    ..Default::default()
                },
                pb::PoolSpec {
                    host_blocks: 0,
                    window: 256,
                    num_blocks: 65_536,
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .expect("register");
    let s = client
        .open_session(pb::OpenSessionRequest {
            holder: "bench".into(),
            ttl_ms: 600_000,
        })
        .await
        .expect("session")
        .into_inner();
    let sequences = (0..256u64)
        .map(|i| pb::SequenceSpec {
            seq_id: i,
            pool_group: "g".into(),
            prompt_tokens: (0..128).map(|t| (i as u32) * 1000 + t).collect(),
            ..Default::default()
        })
        .collect();
    client
        .lease(pb::LeaseRequest {
            session_id: s.session_id,
            epoch: s.epoch,
            step: 0,
            atomic: false,
            sequences,
            warmup: false,
        })
        .await
        .expect("lease");

    let extend = |step: u64| pb::ExtendRequest {
        session_id: s.session_id,
        epoch: s.epoch,
        step,
        atomic: false,
        items: (0..256u64)
            .map(|i| pb::ExtendItem {
                seq_id: i,
                new_tokens: vec![(step as u32) ^ (i as u32)],
                num_tokens: 0,
                traceparent: String::new(),
                written_tokens: 0,
                from_length: 0,
            })
            .collect(),
    };
    let check = || tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    // Warm both paths, then interleave them so drift hits both alike.
    for step in 1..=20 {
        client.extend(extend(step)).await.expect("extend");
        health.check(check()).await.expect("check");
    }
    let (mut t_extend, mut t_empty) = (Duration::ZERO, Duration::ZERO);
    for i in 0..iterations {
        let step = 21 + u64::from(i);
        let req = extend(step);
        let t = Instant::now();
        let out = client.extend(req).await.expect("extend").into_inner();
        t_extend += t.elapsed();
        assert_eq!(out.outcomes.len(), 256);
        let t = Instant::now();
        health.check(check()).await.expect("check");
        t_empty += t.elapsed();
        client
            .complete_step(pb::CompleteStepRequest {
                session_id: s.session_id,
                epoch: s.epoch,
                step,
            })
            .await
            .expect("complete");
    }
    let _ = stop.send(());
    let _ = server.await;
    (t_extend / iterations, t_empty / iterations)
}

fn main() {
    // `cargo bench` passes flags such as `--bench`; nothing to parse.
    let alloc = pool_alloc_free(2.0);
    let lease = lease_release_blocks(2.0);
    let core_extend = core_extend_256(500);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let iterations = 500;
    let (extend, empty) = runtime.block_on(grpc(iterations, None));
    let ratio = extend.as_secs_f64() / empty.as_secs_f64();
    let dir = certs();
    let (tls_extend, tls_empty) = runtime.block_on(grpc(iterations, Some(&dir)));
    let _ = std::fs::remove_dir_all(&dir);
    let tls_ratio = tls_extend.as_secs_f64() / tls_empty.as_secs_f64();
    println!();
    println!("| measure | value | target |");
    println!("|---|---|---|");
    println!(
        "| pool: block allocations + frees per second (one core) | {:.1} M/s | >= 10 M/s |",
        alloc / 1e6
    );
    println!(
        "| core: blocks leased + released per second (256 x 16-block leases, one core) | {:.1} M/s | |",
        lease / 1e6
    );
    println!(
        "| core: Extend of 256 sequences (+1 token each, 2 pools), in process | {:.1} us | |",
        core_extend.as_secs_f64() * 1e6
    );
    println!(
        "| gRPC loopback: Extend of 256 sequences (+1 token each, 2 pools), mean of {iterations} | {:.1} us | |",
        extend.as_secs_f64() * 1e6
    );
    println!(
        "| gRPC loopback: empty unary (health Check), same server, mean of {iterations} | {:.1} us | |",
        empty.as_secs_f64() * 1e6
    );
    println!("| ratio Extend(256) / empty unary | {ratio:.2} | <= 2 |");
    println!(
        "| mTLS loopback: Extend of 256 sequences, mean of {iterations} | {:.1} us | |",
        tls_extend.as_secs_f64() * 1e6
    );
    println!(
        "| mTLS loopback: empty unary (health Check), mean of {iterations} | {:.1} us | |",
        tls_empty.as_secs_f64() * 1e6
    );
    println!("| mTLS ratio Extend(256) / empty unary | {tls_ratio:.2} | |");
    println!(
        "| mTLS ratio / plaintext ratio | {:.2} | <= 1.25 |",
        tls_ratio / ratio
    );
}
