//! `serve_metrics` on 127.0.0.1:0 serves what was recorded, 404s elsewhere, and stops on
//! shutdown.

use std::time::Duration;

use kvlease_telemetry::metrics::{CONTENT_TYPE, Registry, serve_metrics};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// One HTTP/1.1 request over a fresh connection; returns (status line, headers, body).
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
) -> Result<(String, String, String), std::io::Error> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw.as_str(), ""));
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    Ok((
        status.to_owned(),
        headers.to_ascii_lowercase(),
        body.to_owned(),
    ))
}

#[tokio::test]
async fn metrics_endpoint_serves_recorded_values_and_404s_elsewhere() -> TestResult {
    let mut registry = Registry::new();
    let rejects =
        registry.counter_vec("kvlease_rejects_total", "Rejects by reason.", ["reason"])?;
    let blocks = registry.gauge_vec(
        "kvlease_pool_blocks",
        "Blocks by state.",
        ["pool_id", "state"],
    )?;
    let step = registry.histogram("kvlease_step_seconds", "Step latency.", &[0.01, 0.1])?;
    rejects.with(["POOL_EXHAUSTED"]).inc_by(2);
    step.observe(Duration::from_millis(20).as_secs_f64());

    // A gauge mirroring live state, set at scrape time.
    let live_free = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(10));
    let render = {
        let live_free = live_free.clone();
        move || {
            blocks
                .with(["0", "free"])
                .set(live_free.load(std::sync::atomic::Ordering::Relaxed) as f64);
            registry.render()
        }
    };

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_metrics(listener, render, async {
        let _ = stopped.await;
    }));

    let (status, headers, body) = http(addr, "GET", "/metrics").await?;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        headers.contains(&format!("content-type: {CONTENT_TYPE}")),
        "{headers}"
    );
    assert!(
        body.contains("# TYPE kvlease_rejects_total counter\n"),
        "{body}"
    );
    assert!(
        body.contains("kvlease_rejects_total{reason=\"POOL_EXHAUSTED\"} 2\n"),
        "{body}"
    );
    assert!(
        body.contains("kvlease_pool_blocks{pool_id=\"0\",state=\"free\"} 10.0\n"),
        "{body}"
    );
    assert!(
        body.contains("kvlease_step_seconds_bucket{le=\"0.01\"} 0\n"),
        "{body}"
    );
    assert!(
        body.contains("kvlease_step_seconds_bucket{le=\"0.1\"} 1\n"),
        "{body}"
    );
    assert!(body.contains("kvlease_step_seconds_count 1\n"), "{body}");

    // Later changes show in the next scrape.
    live_free.store(3, std::sync::atomic::Ordering::Relaxed);
    rejects.with(["EXCEEDS_CAPACITY"]).inc();
    let (_, _, body) = http(addr, "GET", "/metrics").await?;
    assert!(
        body.contains("kvlease_pool_blocks{pool_id=\"0\",state=\"free\"} 3.0\n"),
        "{body}"
    );
    assert!(
        body.contains("kvlease_rejects_total{reason=\"EXCEEDS_CAPACITY\"} 1\n"),
        "{body}"
    );

    let (status, _, _) = http(addr, "GET", "/").await?;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _, _) = http(addr, "GET", "/metrics/extra").await?;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _, _) = http(addr, "POST", "/metrics").await?;
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");

    // An idle keep-alive connection must not hold shutdown up.
    let _idle = TcpStream::connect(addr).await?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), server).await??;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "listener still open after shutdown"
    );
    Ok(())
}
