//! Two schedulers share one cache service, each with its own worker and its
//! own pool group (`--pool-group-prefix`), through real services on loopback
//! ports. Scheduler A is killed while both serve: B keeps completing requests
//! while A's session is still open at the cache, A's blocks return to its
//! pools when the session's TTL runs out (pools whole, the audit reclaims
//! nothing, B's pools untouched), and A started again with the same group
//! serves.
//!
//! # How A is killed
//!
//! A runs on a tokio runtime of its own, which the test shuts down with
//! `shutdown_background`: every task of A on it (keep-alive, gRPC server
//! and client connections) is dropped where it stands, never polled again.
//! A's step loop runs on a thread of its own, which outlives the runtime
//! (a thread cannot be killed): A reaches the cache only through a
//! [`Cuttable`] proxy, which the test cuts first, so nothing that thread
//! sends afterwards (its `Release`s and `CloseSession` as it winds down)
//! reaches the cache; A's connections to it end as the kernel ends a killed
//! process's. From the cache's side that is `kill -9`: calls stop arriving
//! and the connections end, and only the session's TTL gives A's blocks
//! back.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlease_integration_tests::{
    Service, assert_cache_sound, cache_client, collect, pool_stats, scheduler_client, small_worker,
    start_cache, start_scheduler, start_worker,
};
use kvlease_proto::v1 as pb;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::watch;

const WITHIN: Duration = Duration::from_secs(60);
/// B's cache session TTL, and A's where A is not killed (the cache's
/// shortest by default).
const TTL_MS: u64 = 1_000;
/// A's TTL where it is killed: the test's checks of the dead session (its
/// blocks still held, B's answers while it is open) must come before the
/// cache expires it, and a loaded machine may take a while for them.
const KILLED_TTL_MS: u64 = 10_000;
const GROUP_A: &str = "a/seeded-0/replica-0";
const GROUP_B: &str = "b/seeded-0/replica-0";

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn scheduler(prefix: &str) -> scheduler_svc::Config {
    scheduler_svc::Config {
        pool_group_prefix: prefix.into(),
        holder: format!("scheduler-{prefix}"),
        session_ttl_ms: TTL_MS,
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    }
}

/// Scheduler A over `worker` on a runtime of its own, which the test may
/// shut down to kill it.
/// A TCP pass-through to the cache, on the test's runtime, that the test
/// can cut: every connection through it ends, and later ones are closed as
/// soon as they arrive.
struct Cuttable {
    addr: std::net::SocketAddr,
    cut: watch::Sender<bool>,
}

impl Cuttable {
    async fn start(to: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, is_cut) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if *is_cut.borrow() {
                    continue; // dropped: closed at once
                }
                let mut is_cut = is_cut.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = is_cut.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Self { addr, cut }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

/// Kills A: its way to the cache cut first (see the module's notes), then
/// its runtime dropped.
fn kill_a(to_cache: &Cuttable, rt_a: Runtime, a: Service) {
    to_cache.cut();
    rt_a.shutdown_background();
    drop(a);
}

fn start_a(cache: &str, worker: &Service, ttl_ms: u64) -> (Runtime, Service) {
    let rt = runtime();
    let a = rt
        .block_on(start_scheduler(
            scheduler_svc::Config {
                session_ttl_ms: ttl_ms,
                ..scheduler("a")
            },
            cache,
            &[worker.url()],
            WITHIN,
        ))
        .unwrap();
    (rt, a)
}

fn request(n: u32, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens: (0..40).map(|i| (i * 31 + n * 7) % 250 + 1).collect(),
        max_tokens,
        ..Default::default()
    }
}

async fn stats(cache: &Service) -> pb::GetStatsResponse {
    cache_client(cache.addr)
        .await
        .unwrap()
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner()
}

/// Blocks of `group` in use or fenced.
async fn held(cache: &Service, group: &str) -> u64 {
    pool_stats(cache.addr, group)
        .await
        .unwrap()
        .iter()
        .map(|p| u64::from(p.in_use) + u64::from(p.fenced))
        .sum()
}

/// Requests sent to `scheduler` by `clients` loops until `stop`; each
/// answer's finish reason with the instant it ended. A loop ends at its
/// first failed call (its scheduler is gone).
#[derive(Clone, Default)]
struct Load {
    ended: Arc<Mutex<Vec<(Instant, pb::FinishReason)>>>,
    ok: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Loops not ended yet.
    running: Arc<AtomicU64>,
}

/// Counts its loop out of [`Load::running`] however the loop ends.
struct Running(Arc<AtomicU64>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Load {
    fn start(&self, rt: &Runtime, scheduler: std::net::SocketAddr, clients: u32, max_tokens: u32) {
        for c in 0..clients {
            let load = self.clone();
            load.running.fetch_add(1, Ordering::Relaxed);
            let running = Running(Arc::clone(&load.running));
            rt.spawn(async move {
                let _running = running;
                let mut client = scheduler_client(scheduler).await.unwrap();
                let mut n = c;
                while !load.stop.load(Ordering::Relaxed) {
                    let Ok(g) = collect(&mut client, request(n, max_tokens)).await else {
                        return;
                    };
                    let reason = g.finish_reason();
                    if reason == pb::FinishReason::Length {
                        load.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    load.ended.lock().unwrap().push((Instant::now(), reason));
                    n += clients;
                }
            });
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    fn ended(&self) -> Vec<(Instant, pb::FinishReason)> {
        self.ended.lock().unwrap().clone()
    }

    /// Stops the loops and waits until every loop has ended (a loop ends
    /// after the request it is running).
    async fn finish(&self) {
        self.stop.store(true, Ordering::Relaxed);
        wait_until("every load loop ended", || {
            let running = self.running.load(Ordering::Relaxed);
            async move { running == 0 }
        })
        .await;
    }
}

async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WITHIN;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn a_killed_scheduler_leaves_the_other_serving_and_its_blocks_return_at_its_ttl() {
    let main = runtime();
    let (cache, worker_a, worker_b, b) = main.block_on(async {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker_a = start_worker(small_worker()).await.unwrap();
        let worker_b = start_worker(small_worker()).await.unwrap();
        let b = start_scheduler(scheduler("b"), &cache.url(), &[worker_b.url()], WITHIN)
            .await
            .unwrap();
        (cache, worker_a, worker_b, b)
    });
    // A on a runtime of its own, through a proxy (see the module's notes)
    let to_cache = main.block_on(Cuttable::start(cache.addr));
    let (rt_a, a) = start_a(&to_cache.url(), &worker_a, KILLED_TTL_MS);
    let opened = main.block_on(stats(&cache));
    assert_eq!(opened.sessions, 2, "one session per scheduler");
    let pool_ids = |st: &pb::GetStatsResponse| -> Vec<u32> {
        st.pools
            .iter()
            .filter(|p| p.pool_group == GROUP_A)
            .map(|p| p.pool_id)
            .collect()
    };
    let pools_a = pool_ids(&opened);
    assert!(!pools_a.is_empty());
    assert!(
        opened
            .pools
            .iter()
            .filter(|p| p.pool_group == GROUP_B)
            .all(|p| !pools_a.contains(&p.pool_id)),
        "A and B lease from pools of their own"
    );

    // both serve; A with long requests, so it always holds blocks
    let (load_a, load_b) = (Load::default(), Load::default());
    load_a.start(&main, a.addr, 6, 64);
    load_b.start(&main, b.addr, 2, 8);
    main.block_on(wait_until(
        "both schedulers served and A holds blocks",
        || {
            let (cache, a, b) = (&cache, load_a.ok(), load_b.ok());
            async move { a >= 4 && b >= 4 && held(cache, GROUP_A).await > 0 }
        },
    ));

    kill_a(&to_cache, rt_a, a);
    let killed = Instant::now();
    let held_at_kill = main.block_on(held(&cache, GROUP_A));
    assert!(held_at_kill > 0, "A died holding blocks");

    // B serves while the dead A's session is still open at the cache: two
    // answers after the kill, and A's session still there once they came
    // (sessions only go down: the dead A opens none)
    main.block_on(async {
        let deadline = Instant::now() + WITHIN;
        loop {
            let after_kill = load_b.ended().iter().filter(|(t, _)| *t > killed).count();
            let sessions = stats(&cache).await.sessions;
            if after_kill >= 2 {
                assert_eq!(
                    sessions,
                    2,
                    "A's session expired before B answered twice after the kill ({:?} later): \
                     B waited on it",
                    killed.elapsed()
                );
                break;
            }
            assert!(
                sessions == 2 && Instant::now() < deadline,
                "B answered {after_kill} requests after A's kill, {:?} ago (sessions {sessions})",
                killed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // then A's session expires
        while stats(&cache).await.sessions == 2 {
            assert!(Instant::now() < deadline, "A's session never expired");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });

    main.block_on(async {
        // what A held came back: its pools whole, nothing for the audit
        assert_cache_sound(cache.addr, GROUP_A, WITHIN)
            .await
            .unwrap();
        // B kept serving after the expiry too
        let after = load_b.ok();
        wait_until("B served after A's expiry", || {
            let n = load_b.ok();
            async move { n >= after + 2 }
        })
        .await;
        load_b.finish().await;
        load_a.finish().await;
    });
    let answers = load_b.ended();
    assert!(
        answers
            .iter()
            .all(|(_, reason)| *reason == pb::FinishReason::Length),
        "every request B took ended normally: {:?}",
        answers.iter().map(|(_, r)| *r).collect::<Vec<_>>()
    );
    main.block_on(async {
        assert_cache_sound(cache.addr, GROUP_B, WITHIN)
            .await
            .unwrap();
    });

    // A again, with the same group, on the same worker
    let (rt_a, a) = start_a(&cache.url(), &worker_a, TTL_MS);
    main.block_on(async {
        let st = stats(&cache).await;
        assert_eq!(st.sessions, 2, "A re-opened a session beside B's");
        assert_eq!(pool_ids(&st), pools_a, "A found its pools registered");
        for (scheduler, n) in [(a.addr, 100), (b.addr, 200)] {
            let mut client = scheduler_client(scheduler).await.unwrap();
            for i in 0..3 {
                let g = collect(&mut client, request(n + i, 16)).await.unwrap();
                assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
            }
        }
    });
    rt_a.block_on(a.stop()).unwrap();
    main.block_on(async {
        b.stop().await.unwrap();
        for group in [GROUP_A, GROUP_B] {
            assert_cache_sound(cache.addr, group, WITHIN).await.unwrap();
        }
        assert_eq!(stats(&cache).await.sessions, 0, "both closed theirs");
        worker_a.stop().await.unwrap();
        worker_b.stop().await.unwrap();
        cache.stop().await.unwrap();
    });
}

/// A scheduler started again at once after it was killed finds its group's
/// blocks still held by its dead session: start-up waits for the cache to
/// expire that session (one TTL) instead of failing its warm-up, then
/// serves; nothing leaks.
#[test]
fn a_scheduler_started_again_within_its_ttl_waits_for_its_old_blocks() {
    let main = runtime();
    let (cache, worker_a) = main.block_on(async {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker_a = start_worker(small_worker()).await.unwrap();
        (cache, worker_a)
    });
    let to_cache = main.block_on(Cuttable::start(cache.addr));
    let (rt_a, a) = start_a(&to_cache.url(), &worker_a, KILLED_TTL_MS);
    let load = Load::default();
    load.start(&main, a.addr, 6, 64);
    main.block_on(wait_until("A holds blocks", || {
        let (cache, ok) = (&cache, load.ok());
        async move { ok >= 2 && held(cache, GROUP_A).await > 0 }
    }));
    kill_a(&to_cache, rt_a, a);
    assert!(
        main.block_on(held(&cache, GROUP_A)) > 0,
        "A died holding blocks"
    );

    let started = Instant::now();
    // the same configuration: it waits up to its own TTL for the dead one's
    let (rt_a, a) = start_a(&cache.url(), &worker_a, KILLED_TTL_MS);
    let took = started.elapsed();
    main.block_on(async {
        load.finish().await;
        let mut client = scheduler_client(a.addr).await.unwrap();
        let g = collect(&mut client, request(7, 16)).await.unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
    });
    rt_a.block_on(a.stop()).unwrap();
    main.block_on(async {
        assert_cache_sound(cache.addr, GROUP_A, WITHIN)
            .await
            .unwrap();
        assert_eq!(stats(&cache).await.sessions, 0);
        worker_a.stop().await.unwrap();
        cache.stop().await.unwrap();
    });
    assert!(
        took < WITHIN,
        "start-up took {took:?} with the earlier session's blocks"
    );
}
