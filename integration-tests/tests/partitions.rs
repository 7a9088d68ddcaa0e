//! A worker cut off from the scheduler in the middle of its forward passes,
//! through real services on loopback ports: one of two replicas sits behind
//! a TCP relay that, once cut, passes no byte either way and holds its
//! connections open (what a network partition looks like to both ends: no
//! reset, no answer). The scheduler's HTTP/2 pings to the worker go
//! unanswered, the pass in flight fails, and its requests are requeued on
//! the other replica: every request ends normally, in bounded time, and
//! both replicas' pools are whole with nothing for the audit.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlease_integration_tests::{
    assert_cache_sound, collect, pool_stats, scheduler_client, small_worker, start_cache,
    start_scheduler, start_worker,
};
use kvlease_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

const WITHIN: Duration = Duration::from_secs(60);
const CUT_OFF: &str = "seeded-0/replica-0";
const OTHER: &str = "seeded-0/replica-1";
const KEEPALIVE_MS: u64 = 300;

/// A TCP relay to `upstream` that [`Relay::cut`] turns into a black hole.
struct Relay {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    /// Its tasks, aborted (their sockets closed) by [`Relay::close`].
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let cut_rx = cut.subscribe();
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let spawned = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((downstream, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    // a new connection while cut: nothing gets through
                    continue;
                }
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (dr, dw) = downstream.into_split();
                let (ur, uw) = up.into_split();
                let mut spawned = spawned.lock().unwrap();
                spawned.push(tokio::spawn(pass(dr, uw, cut_rx.clone())).abort_handle());
                spawned.push(tokio::spawn(pass(ur, dw, cut_rx.clone())).abort_handle());
            }
        });
        tasks.lock().unwrap().push(accept.abort_handle());
        Self { addr, cut, tasks }
    }

    /// Closes every connection (so the worker behind it can stop).
    fn close(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

/// Copies `from` to `to` until cut; then holds both ends open, silent.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.wait_for(|c| *c) => break,
        };
        if *cut.borrow() || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if *cut.borrow() {
        std::future::pending::<()>().await;
    }
}

fn request(n: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens: (0..40).map(|i| (i * 13 + n * 11) % 250 + 1).collect(),
        max_tokens: 48,
        ..Default::default()
    }
}

async fn in_use(cache: SocketAddr, group: &str) -> u64 {
    pool_stats(cache, group)
        .await
        .unwrap()
        .iter()
        .map(|p| u64::from(p.in_use))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_mid_forward_has_its_requests_finished_by_the_other_replica() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let cut_off = start_worker(small_worker()).await.unwrap();
    let other = start_worker(small_worker()).await.unwrap();
    let relay = Relay::start(cut_off.addr).await;
    let config = scheduler_svc::Config {
        worker_keepalive_ms: KEEPALIVE_MS,
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[relay.url(), other.url()], WITHIN)
        .await
        .unwrap();

    let requests: Vec<_> = (0..8)
        .map(|n| {
            let addr = scheduler.addr;
            tokio::spawn(async move {
                let mut client = scheduler_client(addr).await.unwrap();
                collect(&mut client, request(n)).await.unwrap()
            })
        })
        .collect();
    // cut while the replica holds requests' blocks (they are in its passes)
    let deadline = Instant::now() + WITHIN;
    while in_use(cache.addr, CUT_OFF).await == 0 {
        assert!(Instant::now() < deadline, "no request reached the replica");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    relay.cut();
    let cut_at = Instant::now();

    let mut requeued = 0;
    for r in requests {
        let g = tokio::time::timeout(WITHIN, r)
            .await
            .expect("the request ended in bounded time")
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        assert_eq!(g.tokens.len(), 48);
        requeued += u32::from(g.preemptions > 0);
    }
    let took = cut_at.elapsed();
    assert!(
        requeued >= 1,
        "the cut-off replica's requests were requeued"
    );
    assert!(
        took < Duration::from_secs(20),
        "the requests outlived the cut by {took:?}"
    );
    for group in [CUT_OFF, OTHER] {
        assert_cache_sound(cache.addr, group, WITHIN).await.unwrap();
    }

    // the replica stays cut off: new requests are served by the other one
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    for n in 100..104 {
        let g = tokio::time::timeout(WITHIN, collect(&mut client, request(n)))
            .await
            .expect("a new request ended in bounded time")
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
    }
    scheduler.stop().await.unwrap();
    for group in [CUT_OFF, OTHER] {
        assert_cache_sound(cache.addr, group, WITHIN).await.unwrap();
    }
    relay.close();
    cut_off.stop().await.unwrap();
    other.stop().await.unwrap();
    cache.stop().await.unwrap();
}
