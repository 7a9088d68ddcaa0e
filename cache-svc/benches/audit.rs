//! `cargo bench -p cache-svc --bench audit`: how long the leak audit holds
//! the cache's lock on a large pool (2^20 blocks, a quarter of them leased),
//! and what a bystander's `GetStats` waits while an `Audit` runs, printed as
//! one table.
//!
//! 1. In-process: the whole audit in one call (what every other call waited
//!    before the audit was sliced) against the longest single slice.
//! 2. Over gRPC on loopback: `GetStats` latency with nothing else running,
//!    then while `Audit` calls run back to back on another connection.
//!
//! Figures from one run are only comparable with each other.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the bench

use std::time::{Duration, Instant};

use cache_svc::cache::{AUDIT_SLICE_BLOCKS, AuditCursor, AuditReport, Batch, Cache, CacheConfig};
use cache_svc::lease::{Prompt, SeqSpec};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;

const BLOCKS: u32 = 1 << 20;
/// Sequences of 64 blocks (16 tokens a block) leased before measuring.
const SEQS: u64 = 4096;

fn leased_cache() -> (Cache, cache_svc::SessionId, cache_svc::Epoch) {
    let mut cache = Cache::with_epoch(CacheConfig::default(), cache_svc::Epoch(1));
    cache.register_pool("g", 16, &[(0, BLOCKS)]).unwrap();
    let now = Instant::now();
    let s = cache.open_session("bench", None, now).unwrap();
    let specs: Vec<SeqSpec> = (0..SEQS)
        .map(|i| SeqSpec::new(cache_svc::SeqId(i), "g", Prompt::Count(64 * 16)))
        .collect();
    cache
        .lease(
            s.session_id,
            s.epoch,
            Batch {
                step: cache_svc::Step(1),
                ..Batch::default()
            },
            &specs,
            now,
        )
        .unwrap();
    (cache, s.session_id, s.epoch)
}

/// (whole audit, longest slice, all slices, slices), in-process.
fn in_process() -> (Duration, Duration, Duration, usize) {
    let (mut cache, _, _) = leased_cache();
    let start = Instant::now();
    let report = cache.audit();
    let whole = start.elapsed();
    assert!(report.reclaimed.is_empty());
    let mut report = AuditReport::default();
    let mut cursor = AuditCursor::default();
    let (mut longest, mut all, mut slices) = (Duration::ZERO, Duration::ZERO, 0);
    loop {
        let start = Instant::now();
        let next = cache.audit_slice(cursor, AUDIT_SLICE_BLOCKS, &mut report);
        longest = longest.max(start.elapsed());
        all += start.elapsed();
        slices += 1;
        match next {
            Some(c) => cursor = c,
            None => break,
        }
    }
    assert_eq!(report.blocks_checked, u64::from(BLOCKS));
    (whole, longest, all, slices)
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

/// GetStats latencies (idle, during audits) and audits run, over gRPC.
async fn over_grpc(samples: usize) -> (Vec<Duration>, Vec<Duration>, usize) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(cache_svc::run(
        listener,
        cache_svc::Config {
            audit_interval_ms: 0,
            ..cache_svc::Config::default()
        },
        async {
            let _ = stop_rx.await;
        },
    ));
    let connect = || async {
        let mut tries = 0;
        loop {
            match CacheServiceClient::connect(format!("http://{addr}")).await {
                Ok(c) => return c,
                Err(_) if tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("connect: {e}"),
            }
        }
    };
    let mut c = connect().await;
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: "g".into(),
        tokens_per_block: 16,
        pools: vec![pb::PoolSpec {
            host_blocks: 0,
            window: 0,
            num_blocks: u64::from(BLOCKS),
            ..Default::default()
        }],
        ..Default::default()
    })
    .await
    .unwrap();
    let s = c
        .open_session(pb::OpenSessionRequest {
            holder: "bench".into(),
            ttl_ms: 600_000,
        })
        .await
        .unwrap()
        .into_inner();
    for chunk in 0..(SEQS / 1024) {
        c.lease(pb::LeaseRequest {
            session_id: s.session_id,
            epoch: s.epoch,
            step: 1,
            sequences: (0..1024)
                .map(|i| pb::SequenceSpec {
                    seq_id: chunk * 1024 + i,
                    pool_group: "g".into(),
                    num_tokens: 64 * 16,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let stats = |mut c: CacheServiceClient<tonic::transport::Channel>| async move {
        let mut lat = Vec::with_capacity(samples);
        for _ in 0..samples {
            let start = Instant::now();
            c.get_stats(pb::GetStatsRequest::default()).await.unwrap();
            lat.push(start.elapsed());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        lat
    };
    let idle = stats(connect().await).await;
    let auditor = connect().await;
    let (done_tx, mut done_rx) = tokio::sync::watch::channel(false);
    let audits = tokio::spawn(async move {
        let mut c = auditor;
        let mut n = 0;
        while !*done_rx.borrow_and_update() {
            let r = c.audit(pb::AuditRequest {}).await.unwrap().into_inner();
            assert!(r.reclaimed.is_empty());
            n += 1;
        }
        n
    });
    let busy = stats(connect().await).await;
    done_tx.send_replace(true);
    let audits = audits.await.unwrap();
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    (idle, busy, audits)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let (whole, longest, all, slices) = in_process();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (idle, busy, audits) = runtime.block_on(over_grpc(300));
    println!(
        "leak audit of a {BLOCKS}-block pool, {} blocks leased",
        SEQS * 64
    );
    println!("| figure | value |");
    println!("|---|---|");
    println!("| whole audit, one lock hold (before) | {} |", ms(whole));
    println!(
        "| longest slice of {AUDIT_SLICE_BLOCKS} blocks ({slices} slices) | {} |",
        ms(longest)
    );
    println!(
        "| mean slice / all slices | {} / {} |",
        ms(all / slices as u32),
        ms(all)
    );
    println!(
        "| whole / longest slice | {:.1}x |",
        whole.as_secs_f64() / longest.as_secs_f64()
    );
    println!(
        "| GetStats p50 / max, idle | {} / {} |",
        ms(percentile(idle.clone(), 0.5)),
        ms(percentile(idle, 1.0))
    );
    println!(
        "| GetStats p50 / p99 / max, {audits} Audit calls running | {} / {} / {} |",
        ms(percentile(busy.clone(), 0.5)),
        ms(percentile(busy.clone(), 0.99)),
        ms(percentile(busy, 1.0))
    );
}
