//! Issue 29, findings 2, 4 and 5, against the real gateway (and a real cluster behind it):
//! - slowloris: clients sending one header line at a time held every connection slot, and
//!   a trickling client was never closed;
//! - `--token-file` was accepted and ignored: no token or a made-up one got 200;
//! - the tenant was OpenAI's `user` field: `user=alice` read alice's cached prefix.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::time::Duration;

use kvlease_integration_tests::{small_worker, start_cache, start_scheduler, start_worker};
use kvlease_runtime::limits::ServeLimits;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A gateway on a loopback port; the scheduler behind it is `scheduler` (none needed for
/// the routes that do not generate: its channel connects lazily).
struct Gateway {
    http: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), kvlease_gateway::Error>>,
}

impl Gateway {
    async fn start(config: kvlease_gateway::Config) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kvlease_gateway::run(listener, config, async {
            let _ = stopped.await;
        }));
        Self { http, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// One HTTP/1.1 request on its own connection: the status and the body, or the I/O error
/// that ended it (a connection refused by the gate is closed before any answer).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> std::io::Result<(u16, String)> {
    let mut conn = TcpStream::connect(addr).await?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n{auth}\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await?;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP answer: {answer:?}")))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Ok((status, body))
}

/// A slowloris client: a request line, then one header line every `every`, never ending
/// the headers. The task ends with the time the gateway closed the connection.
async fn slowloris(addr: SocketAddr, every: Duration) -> JoinHandle<tokio::time::Instant> {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /v1/models HTTP/1.1\r\n")
        .await
        .unwrap();
    tokio::spawn(async move {
        for i in 0u64.. {
            tokio::time::sleep(every).await;
            let line = format!("x-slow-{i}: {i}\r\n");
            if conn.write_all(line.as_bytes()).await.is_err() {
                break;
            }
            // a closed connection shows as EOF (or a reset) on a read
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_millis(1), conn.read(&mut byte));
            if let Ok(Ok(0) | Err(_)) = read.await {
                break;
            }
        }
        tokio::time::Instant::now()
    })
}

fn gateway_config(limits: ServeLimits) -> kvlease_gateway::Config {
    kvlease_gateway::Config {
        // nothing listens there: these tests never generate
        scheduler_addr: "http://127.0.0.1:9".into(),
        limits,
        ..kvlease_gateway::Config::default()
    }
}

#[tokio::test]
async fn slowloris_clients_do_not_lock_out_a_real_client() {
    let gateway = Gateway::start(gateway_config(ServeLimits {
        max_connections: 4,
        // long enough that only eviction can make room during the test
        handshake_timeout_ms: 120_000,
        ..ServeLimits::default()
    }))
    .await;
    let mut slow = Vec::new();
    for _ in 0..4 {
        slow.push(slowloris(gateway.http, Duration::from_millis(200)).await);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(slow.iter().all(|s| !s.is_finished()));
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        request(gateway.http, "GET", "/v1/models", None, None),
    )
    .await
    .expect("a real client waited past 10 s");
    let (status, body) = answered.expect("a real client was locked out by slowloris clients");
    // answered: 503, since no scheduler listens behind this gateway
    assert_eq!(status, 503, "{body}");
    for s in slow {
        s.abort();
    }
    gateway.stop().await;
}

#[tokio::test]
async fn a_slowloris_client_is_closed_at_the_handshake_deadline() {
    let gateway = Gateway::start(gateway_config(ServeLimits {
        handshake_timeout_ms: 1_000,
        ..ServeLimits::default()
    }))
    .await;
    let start = tokio::time::Instant::now();
    let slow = slowloris(gateway.http, Duration::from_millis(100)).await;
    let closed = tokio::time::timeout(Duration::from_secs(10), slow)
        .await
        .expect("a client trickling header lines outlived the 1 s deadline by 9 s")
        .unwrap();
    assert!(closed - start >= Duration::from_millis(900));
    gateway.stop().await;
}

#[tokio::test]
async fn a_body_sent_too_slowly_gets_408() {
    let gateway = Gateway::start(kvlease_gateway::Config {
        body_timeout_ms: 500,
        ..gateway_config(ServeLimits::default())
    })
    .await;
    let mut conn = TcpStream::connect(gateway.http).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 100\r\n\r\n{";
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_string(&mut answer))
        .await
        .expect("a body that never arrives held the connection")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    gateway.stop().await;
}

/// The token file of the tests: two clients, an observer.
const TOKENS: &str = "\
alice-token-0123456789 alice client
bob-token-0123456789ab bob client
watch-token-0123456789 watcher observer
";

fn token_file() -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvlease-gw-tokens-{}", std::process::id()));
    std::fs::write(&path, TOKENS).unwrap();
    path
}

fn with_tokens(mut config: kvlease_gateway::Config) -> kvlease_gateway::Config {
    config.security.token_file = Some(token_file());
    config
}

#[tokio::test]
async fn the_gateway_enforces_its_token_file() {
    let gateway = Gateway::start(with_tokens(gateway_config(ServeLimits::default()))).await;
    let addr = gateway.http;
    let completion = json!({"model": "kvlease", "prompt": "x", "max_tokens": 1});
    for (path, body) in [
        ("/v1/models", None),
        ("/v1/completions", Some(completion.clone())),
    ] {
        let method = if body.is_some() { "POST" } else { "GET" };
        let (status, text) = request(addr, method, path, None, body.clone())
            .await
            .unwrap();
        assert_eq!(status, 401, "{path} without a token: {text}");
        assert!(text.contains("Authorization"), "{text}");
        let (status, text) = request(addr, method, path, Some("made-up-token-0123456"), body)
            .await
            .unwrap();
        assert_eq!(status, 401, "{path} with a made-up token: {text}");
        assert!(text.contains("unknown bearer token"), "{text}");
    }
    let (status, text) = request(
        addr,
        "GET",
        "/v1/models",
        Some("watch-token-0123456789"),
        None,
    )
    .await
    .unwrap();
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("needs role client"), "{text}");
    let (status, text) = request(
        addr,
        "GET",
        "/v1/models",
        Some("alice-token-0123456789"),
        None,
    )
    .await
    .unwrap();
    // past the token check: the 503 of a gateway with no scheduler behind it
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("scheduler"), "{text}");
    // health stays open to probes
    let (status, _) = request(addr, "GET", "/health", None, None).await.unwrap();
    assert_ne!(status, 401);
    gateway.stop().await;
}

/// `cached_tokens` of a completion of `prompt` by the holder of `token` labelled `user`.
async fn cached_tokens(addr: SocketAddr, token: &str, user: &str, prompt: &str) -> u64 {
    let body = json!({"model": "kvlease", "prompt": prompt, "max_tokens": 2, "temperature": 0, "user": user});
    let (status, text) = request(addr, "POST", "/v1/completions", Some(token), Some(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_is_the_authenticated_principal_not_the_user_field() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let scheduler = start_scheduler(
        scheduler_svc::Config {
            max_context: 256,
            max_tokens: 200,
            ..scheduler_svc::Config::default()
        },
        &cache.url(),
        &[worker.url()],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let gateway = Gateway::start(with_tokens(kvlease_gateway::Config {
        scheduler_addr: scheduler.url(),
        ..kvlease_gateway::Config::default()
    }))
    .await;
    let addr = gateway.http;
    let alice = "alice-token-0123456789";
    let bob = "bob-token-0123456789ab";
    let secret = "alice's secret prefix: the paged KV cache lends blocks to work.";
    assert_eq!(cached_tokens(addr, alice, "alice", secret).await, 0);
    // alice's own repeat reuses her prefix, whatever label she gives
    assert!(cached_tokens(addr, alice, "someone-else", secret).await > 0);
    // bob claiming to be alice reuses nothing
    assert_eq!(
        cached_tokens(addr, bob, "alice", secret).await,
        0,
        "bob read alice's cached prefix by setting user=alice"
    );

    // point 9: a 1 MB stop string is a 400 with a short message, not an echo of the
    // megabyte (which pushed the reply over the message cap: a 429)
    let huge = "s".repeat(1 << 20);
    let body = json!({"model": "kvlease", "prompt": "x", "max_tokens": 2, "stop": huge});
    let (status, text) = request(addr, "POST", "/v1/completions", Some(alice), Some(body))
        .await
        .unwrap();
    assert_eq!(status, 400, "{}", &text[..text.len().min(300)]);
    assert!(text.len() < 1024, "a {} byte answer", text.len());
    assert!(text.contains("1048576 bytes"), "{text}");
    // and the scheduler itself, asked over gRPC, echoes no more
    let mut grpc = kvlease_integration_tests::scheduler_client(scheduler.addr)
        .await
        .unwrap();
    let refused = grpc
        .generate(kvlease_proto::v1::GenerateRequest {
            text: "x".into(),
            max_tokens: 2,
            stop: vec![huge],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().len() < 1024,
        "{} bytes",
        refused.message().len()
    );

    gateway.stop().await;
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}
