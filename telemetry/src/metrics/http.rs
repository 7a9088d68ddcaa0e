//! `GET /metrics` over hyper 1.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Content type of the Prometheus text exposition format (0.0.4), which
/// [`super::Registry::render`] writes.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Serves `GET /metrics` with the text `render` returns (usually [`super::Registry::render`],
/// after setting gauges that mirror live state), 405 for other methods there, 404 elsewhere.
/// Returns once `shutdown` completes and the open connections have finished.
///
/// ```ignore
/// let mut registry = kvlease_telemetry::metrics::Registry::new();
/// let free = registry.gauge_vec("kvlease_pool_blocks", "Blocks by state.", ["pool_id", "state"])?;
/// tokio::spawn(kvlease_telemetry::metrics::serve_metrics(listener, move || {
///     free.with(["0", "free"]).set(pool.free() as f64);
///     registry.render()
/// }, shutdown));
/// ```
pub async fn serve_metrics<R, F>(listener: TcpListener, render: R, shutdown: F)
where
    R: Fn() -> String + Send + Sync + 'static,
    F: Future<Output = ()> + Send,
{
    let render = Arc::new(render);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(err) => {
                    // Out of file descriptors and the like: transient; do not spin on it.
                    tracing::warn!(error = %err, "metrics listener accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Reap finished connections so the set does not grow with every scrape.
        while connections.try_join_next().is_some() {}
        let render = Arc::clone(&render);
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let render = Arc::clone(&render);
                async move { Ok::<_, Infallible>(respond(&request, render.as_ref())) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                // `wait_for`'s guard is not `Send`; `changed` only fires with `true`.
                _ = stop.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(err) = result {
                tracing::debug!(error = %err, "metrics connection ended with an error");
            }
        });
    }
    let _ = stop_tx.send(true);
    while connections.join_next().await.is_some() {}
}

fn respond<R: Fn() -> String + ?Sized>(
    request: &Request<Incoming>,
    render: &R,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => (StatusCode::OK, CONTENT_TYPE, render()),
        (_, "/metrics") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "method not allowed\n".to_owned(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    response
}
