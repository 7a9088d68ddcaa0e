//! The disk tier through a real cluster (cache, CPU worker with a small
//! host tier and a disk tier in a directory of its own, scheduler, on
//! loopback ports): a prompt is pushed out of the device pool and then out
//! of the host tier by six others, so its prefix lives only in block files;
//! repeating it loads them (reused tokens > 0) with the same greedy output
//! as its first run. Then the worker and the scheduler start again over the
//! same directory: the worker announces its files, the cache indexes them
//! under the new incarnation, and the prompt comes back from disk again.
//! Last, every block file is corrupted under the running worker: the load
//! fails the pass, the scheduler recomputes (same output), and the cache
//! never trusts those blocks again. The pools end whole and the leak audit
//! reclaims nothing after each case.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvlease::cluster::Service;
use kvlease_integration_tests::{
    GROUP, Generated, assert_cache_sound, generate_settled, pool_stats, scheduler_client,
    small_worker, start_cache, start_scheduler, start_worker,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
const READY: Duration = Duration::from_secs(30);

fn prompt(i: u32) -> Vec<u32> {
    (0..64).map(|j| (j * 13 + i * 37 + 5) % 250 + 1).collect()
}

fn temp_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("kvlease-disk-tier-{}-{nanos}", std::process::id()))
}

/// The small worker with 4 host blocks per pool and a disk tier in `dir`.
fn disk_worker(dir: &Path) -> worker_svc::Config {
    worker_svc::Config {
        host_blocks: 4,
        disk_tier_dir: Some(dir.to_path_buf()),
        disk_tier_bytes: Some(16 << 20),
        ..small_worker()
    }
}

/// A scheduler for the small worker whose tenant salts come from `secret`.
fn scheduler_config(secret: &Path) -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        salt_secret_file: Some(secret.to_path_buf()),
        ..scheduler_svc::Config::default()
    }
}

/// A worker over `dir` and a scheduler whose tenant salts come from
/// `secret` (a random key per start would hash the same prompt otherwise
/// after the restart, and nothing cached before it could ever match).
async fn start_pair(cache: &Service, dir: &Path, secret: &Path) -> (Service, Service) {
    let worker = start_worker(disk_worker(dir)).await.unwrap();
    let scheduler = start_scheduler(
        scheduler_config(secret),
        &cache.url(),
        &[worker.url()],
        READY,
    )
    .await
    .unwrap();
    (worker, scheduler)
}

async fn generate(cache: &Service, scheduler: &Service, tokens: Vec<u32>) -> Generated {
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    generate_settled(&mut client, cache.addr, tokens, 4).await
}

/// Six other prompts: the first one's blocks leave the device (5 of each
/// pool's 20 blocks a prompt) and then the 4-block host tier.
async fn push_to_disk(cache: &Service, scheduler: &Service) {
    for i in 1..=6 {
        generate(cache, scheduler, prompt(i)).await;
    }
}

fn sum(stats: &[pb::PoolStats], f: impl Fn(&pb::PoolStats) -> u64) -> u64 {
    stats.iter().map(f).sum()
}

fn assert_tiers_settled(stats: &[pb::PoolStats]) {
    for p in stats {
        assert_eq!((p.host_pending, p.host_pinned), (0, 0), "{p:?}");
        assert_eq!((p.disk_pending, p.disk_pinned), (0, 0), "{p:?}");
        assert_eq!(
            p.disk_free + p.disk_cached + p.disk_pending + p.disk_pinned,
            p.disk_total,
            "{p:?}"
        );
        assert!(p.disk_total > 0, "{p:?}");
    }
}

fn corrupt_every_file(dir: &Path) -> usize {
    let mut n = 0;
    for pool in std::fs::read_dir(dir).unwrap() {
        for file in std::fs::read_dir(pool.unwrap().path()).unwrap() {
            let path = file.unwrap().path();
            let mut bytes = std::fs::read(&path).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 0x55;
            std::fs::write(&path, bytes).unwrap();
            n += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_from_device_and_host_comes_back_from_disk_also_after_a_restart() {
    let dir = temp_dir();
    let secret = dir.with_extension("secret");
    std::fs::write(&secret, b"a salt secret that outlives the scheduler").unwrap();
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let (worker, scheduler) = start_pair(&cache, &dir, &secret).await;

    // 1. Device -> host -> disk, and back from disk.
    let first = generate(&cache, &scheduler, prompt(0)).await;
    assert_eq!(first.reused_tokens, 0);
    push_to_disk(&cache, &scheduler).await;
    let before = pool_stats(cache.addr, GROUP).await.unwrap();
    assert!(sum(&before, |p| p.spills) > 0, "{before:?}");
    let again = generate(&cache, &scheduler, prompt(0)).await;
    assert_eq!(again.reused_tokens, 48, "three full prompt blocks");
    assert_eq!(again.tokens, first.tokens, "same greedy output");
    let stats = pool_stats(cache.addr, GROUP).await.unwrap();
    for (p, b) in stats.iter().zip(&before) {
        assert!(p.loads > b.loads, "loaded from disk: {p:?}");
    }
    assert_tiers_settled(&stats);
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();

    // 2. The worker (and its scheduler) start again over the same
    // directory: device and host memory are gone, the files are not.
    push_to_disk(&cache, &scheduler).await;
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    let (worker, scheduler) = start_pair(&cache, &dir, &secret).await;
    let restarted = pool_stats(cache.addr, GROUP).await.unwrap();
    for p in &restarted {
        assert_eq!(p.cached_evictable, 0, "device memory forgotten: {p:?}");
        assert_eq!(p.host_cached, 0, "host memory forgotten: {p:?}");
        assert!(p.disk_cached > 0, "the files are indexed: {p:?}");
    }
    let after_restart = generate(&cache, &scheduler, prompt(0)).await;
    assert_eq!(after_restart.reused_tokens, 48);
    assert_eq!(after_restart.tokens, first.tokens);
    let stats = pool_stats(cache.addr, GROUP).await.unwrap();
    for (p, b) in stats.iter().zip(&restarted) {
        assert!(p.loads > b.loads, "loaded from disk: {p:?}");
    }
    assert_tiers_settled(&stats);
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();

    // 3. Every block file goes bad under the running worker: the load is a
    // miss that fails the pass, the request is recomputed with the same
    // output, and the cache drops what the pass loaded.
    push_to_disk(&cache, &scheduler).await;
    assert!(corrupt_every_file(&dir) > 0);
    let before = pool_stats(cache.addr, GROUP).await.unwrap();
    let recomputed = generate(&cache, &scheduler, prompt(0)).await;
    assert_eq!(recomputed.tokens, first.tokens, "never wrong KV");
    assert_eq!(recomputed.preemptions, 1, "the failed pass was recomputed");
    let stats = pool_stats(cache.addr, GROUP).await.unwrap();
    for (p, b) in stats.iter().zip(&before) {
        assert!(p.disk_invalidated > b.disk_invalidated, "{p:?}");
    }
    assert_tiers_settled(&stats);
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();

    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_file(&secret).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_disk_tiers_in_register_pool_are_refused_naming_the_field() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let mut client = kvlease_integration_tests::cache_client(cache.addr)
        .await
        .unwrap();
    let spec = |disk_blocks: u64, host_blocks: u64, held: Vec<pb::DiskBlock>| pb::PoolSpec {
        window: 0,
        num_blocks: 8,
        host_blocks,
        disk_blocks,
        disk_held: held,
        ..Default::default()
    };
    let held = |block| pb::DiskBlock {
        block,
        hash: 7,
        parent: 0,
    };
    let cases = [
        (0, spec(4, 2, vec![]), "needs a worker_incarnation"),
        (1, spec(4, 0, vec![]), "needs a host tier"),
        (1, spec(4, 2, vec![held(4)]), "disk_held"),
        (1, spec(4, 2, vec![held(1), held(1)]), "listed twice"),
        (1, spec(u64::from(u32::MAX) + 1, 2, vec![]), "disk_blocks"),
        (1, spec(1 << 25, 2, vec![]), "disk_blocks"),
    ];
    for (i, (incarnation, pool, want)) in cases.into_iter().enumerate() {
        let group = format!("disk/{i}");
        let status = client
            .register_pool(pb::RegisterPoolRequest {
                pool_group: group.clone(),
                tokens_per_block: 4,
                pools: vec![pool],
                worker_incarnation: incarnation,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(want), "{status:?} lacks {want:?}");
        // nothing registered
        let stats = client
            .get_stats(pb::GetStatsRequest { pool_group: group })
            .await;
        assert!(
            stats.is_err() || stats.unwrap().into_inner().pools.is_empty(),
            "a refused registration registered something"
        );
    }
    cache.stop().await.unwrap();
}

/// A worker restarted while an earlier session (a scheduler killed with it)
/// still holds blocks of its group: the cache refuses the new incarnation
/// (`ABORTED`, nothing forgotten under the holder), and the new
/// scheduler's start-up waits until the blocks come back, then serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_incarnation_waits_for_an_earlier_session_to_give_its_blocks_back() {
    let dir = temp_dir();
    let secret = dir.with_extension("secret");
    std::fs::write(&secret, b"another salt secret").unwrap();
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(disk_worker(&dir)).await.unwrap();
    let d = kvlease_integration_tests::worker_client(worker.addr)
        .await
        .unwrap()
        .describe(pb::DescribeRequest {})
        .await
        .unwrap()
        .into_inner();
    // The group as an earlier incarnation of the worker registered it, and
    // a sequence of an earlier session holding blocks of it.
    let mut c = kvlease_integration_tests::cache_client(cache.addr)
        .await
        .unwrap();
    let pools = d
        .pools
        .iter()
        .map(|p| pb::PoolSpec {
            window: p.window.into(),
            num_blocks: p.num_blocks.into(),
            host_blocks: p.host_blocks.into(),
            ..Default::default()
        })
        .collect();
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: GROUP.into(),
        tokens_per_block: d.tokens_per_block.into(),
        pools,
        worker_incarnation: d.incarnation ^ 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let (session_id, epoch) = kvlease_integration_tests::hold_blocks(&mut c, "earlier", 40)
        .await
        .unwrap();
    // The new scheduler starts; the earlier session ends a little later.
    let starting = tokio::spawn({
        let (cache, worker) = (cache.url(), worker.url());
        let secret = secret.clone();
        async move { start_scheduler(scheduler_config(&secret), &cache, &[worker], READY).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!starting.is_finished(), "start-up waits for the blocks");
    c.close_session(pb::CloseSessionRequest { session_id, epoch })
        .await
        .unwrap();
    let scheduler = starting.await.unwrap().unwrap();
    let out = generate(&cache, &scheduler, prompt(0)).await;
    assert_eq!(out.tokens.len(), 4);
    let stats = pool_stats(cache.addr, GROUP).await.unwrap();
    assert!(stats.iter().all(|p| p.disk_total > 0), "{stats:?}");
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_file(&secret).unwrap();
}
