//! An OTLP/gRPC trace receiver for tests (the `opentelemetry-proto` tonic
//! server on 127.0.0.1:0), keeping every span with the resource it came
//! under, and a trace's spans printed as a tree.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio_stream::wrappers::TcpListenerStream;

/// A span as received, with its resource's `service.name` and
/// `service.instance.id`.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub instance: String,
    pub span: Span,
}

/// The receiver: its address and what it got so far.
#[derive(Debug, Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    exports: Arc<Mutex<u64>>,
}

struct Service {
    spans: Arc<Mutex<Vec<Received>>>,
    exports: Arc<Mutex<u64>>,
    delay: Duration,
}

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        // a slow collector: the answer comes `delay` late
        tokio::time::sleep(self.delay).await;
        let mut received = Vec::new();
        for rs in request.into_inner().resource_spans {
            let attributes = rs.resource.map(|r| r.attributes).unwrap_or_default();
            let service = string(&attributes, "service.name").unwrap_or_default();
            let instance = string(&attributes, "service.instance.id").unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                received.push(Received {
                    service: service.clone(),
                    instance: instance.clone(),
                    span,
                });
            }
        }
        if let Ok(mut all) = self.spans.lock() {
            all.extend(received);
        }
        if let Ok(mut n) = self.exports.lock() {
            *n += 1;
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Starts a receiver on its own thread and runtime (so it outlives any
    /// test's runtime) that answers each export `delay` late.
    pub fn start(delay: Duration) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let spans = Arc::default();
        let exports = Arc::default();
        let service = Service {
            spans: Arc::clone(&spans),
            exports: Arc::clone(&exports),
            delay,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let _ = tonic::transport::Server::builder()
                    .add_service(TraceServiceServer::new(service))
                    .serve_with_incoming(TcpListenerStream::new(listener))
                    .await;
            });
        });
        Ok(Self {
            addr,
            spans,
            exports,
        })
    }

    /// The endpoint for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Installs this process's telemetry, exporting every span here (logs
    /// at `warn`). Keep the guard until the spans are read.
    pub fn export_here(&self) -> kvlease_telemetry::Result<kvlease_telemetry::TelemetryGuard> {
        kvlease_telemetry::init_with(kvlease_telemetry::TelemetryConfig {
            otlp_endpoint: Some(self.endpoint()),
            log_filter: "warn".into(),
            ..kvlease_telemetry::TelemetryConfig::new("kvlease-integration-tests")
        })
    }

    /// Every span received so far.
    pub fn snapshot(&self) -> Vec<Received> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Export requests answered so far.
    pub fn exports(&self) -> u64 {
        self.exports.lock().map(|n| *n).unwrap_or(0)
    }

    /// Polls until `done` holds for the spans received, or `within` passed;
    /// returns the last snapshot either way.
    pub async fn until(
        &self,
        within: Duration,
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let snapshot = self.snapshot();
            if done(&snapshot) || tokio::time::Instant::now() > deadline {
                return snapshot;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

// === a traced bench ===

/// One request of [`traced_bench`]: its trace id and how it ended.
#[derive(Debug, Clone)]
pub struct Sent {
    pub trace: [u8; 16],
    pub result: crate::Generated,
}

/// Lower-case hex, as W3C trace context writes ids.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn trace_id(n: u32) -> [u8; 16] {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&nanos.to_be_bytes());
    id[12..].copy_from_slice(&n.to_be_bytes());
    id[15] |= 1;
    id
}

/// Sends `requests` requests at once (distinct prompts of `prompt` tokens,
/// `max_tokens` each), each under its own W3C trace id, as a client that
/// traces its calls would.
pub async fn traced_bench(
    scheduler: SocketAddr,
    requests: u32,
    prompt: u32,
    max_tokens: u32,
) -> Result<Vec<Sent>, crate::Error> {
    // one connection for all, as a real client multiplexes its calls: a
    // connection per call would be hundreds of connections from one address
    // at once, which the servers' connection limits close before their
    // first call (`--max-pending-per-peer`)
    let shared = crate::scheduler_client(scheduler).await?;
    let calls = (0..requests).map(|n| {
        let mut client = shared.clone();
        async move {
            let trace = trace_id(n);
            let mut request = tonic::Request::new(kvlease_proto::v1::GenerateRequest {
                tokens: (0..prompt).map(|t| (t * 7 + n * 13) % 250 + 1).collect(),
                max_tokens,
                ..Default::default()
            });
            let parent = format!("00-{}-{}-01", hex(&trace), hex(&trace[..8]));
            if let Ok(value) = parent.parse() {
                request.metadata_mut().insert("traceparent", value);
            }
            let result = crate::collect(&mut client, request).await?;
            Ok::<_, crate::Error>(Sent { trace, result })
        }
    });
    futures::future::join_all(calls).await.into_iter().collect()
}

// === an over-subscribed cluster ===

/// A cache, two small workers (two pool groups) and a scheduler that
/// over-subscribes them: a refused sequence is preempted once, then
/// rejected. With a few hundred requests of ~50 tokens both happen.
#[derive(Debug)]
pub struct OversubscribedCluster {
    pub cache: crate::Service,
    pub workers: [crate::Service; 2],
    pub scheduler: crate::Service,
}

impl OversubscribedCluster {
    pub async fn start() -> Result<Self, crate::Error> {
        let cache = crate::start_cache(cache_svc::Config::default()).await?;
        let w0 = crate::start_worker(crate::small_worker_with(2, 192)).await?;
        let w1 = crate::start_worker(crate::small_worker_with(2, 192)).await?;
        let scheduler = crate::start_scheduler(
            scheduler_svc::Config {
                policy: scheduler_svc::policy::Policy::MaxUtilization,
                on_exhausted: scheduler_svc::policy::OnExhausted::Preempt,
                max_preemptions: 1,
                max_context: 256,
                max_tokens: 200,
                // `traced_bench` opens a connection per request, all at
                // once: 2,000 in the export-load test, a burst the default
                // caps (1,024 open, 128 not yet heard from) would cut
                limits: kvlease_runtime::limits::ServeLimits {
                    max_connections: 4096,
                    max_pending_handshakes: 4096,
                    ..Default::default()
                },
                ..scheduler_svc::Config::default()
            },
            &cache.url(),
            &[w0.url(), w1.url()],
            crate::READY_WITHIN,
        )
        .await?;
        Ok(Self {
            cache,
            workers: [w0, w1],
            scheduler,
        })
    }

    /// Stops the scheduler, then the workers, then the cache.
    pub async fn stop(self) {
        let _ = self.scheduler.stop().await;
        for w in self.workers {
            let _ = w.stop().await;
        }
        let _ = self.cache.stop().await;
    }
}

// === reading spans ===

/// The value of attribute `key` among `attributes` (a span's or a link's).
pub fn value<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attributes
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()
}

fn string(attributes: &[KeyValue], key: &str) -> Option<String> {
    match value(attributes, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// A string attribute of `span`.
pub fn attr_str(span: &Span, key: &str) -> Option<String> {
    string(&span.attributes, key)
}

/// An integer attribute of `span` (strings do not count: integers must be
/// exported as integers).
pub fn attr_int(span: &Span, key: &str) -> Option<i64> {
    match value(&span.attributes, key)? {
        AnyValue::IntValue(i) => Some(*i),
        _ => None,
    }
}

/// A boolean attribute of `span`.
pub fn attr_bool(span: &Span, key: &str) -> Option<bool> {
    match value(&span.attributes, key)? {
        AnyValue::BoolValue(b) => Some(*b),
        _ => None,
    }
}

/// An integer-array attribute of `span`.
pub fn attr_ints(span: &Span, key: &str) -> Vec<i64> {
    match value(&span.attributes, key) {
        Some(AnyValue::ArrayValue(a)) => a
            .values
            .iter()
            .filter_map(|v| match v.value.as_ref()? {
                AnyValue::IntValue(i) => Some(*i),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// `spans` (one trace) as an indented tree: name, service, status and the
/// `kvlease.*`/`rpc.*` attributes of each span, children in start order.
pub fn tree(spans: &[&Received]) -> String {
    let ids: Vec<&[u8]> = spans.iter().map(|s| s.span.span_id.as_slice()).collect();
    let mut children: HashMap<&[u8], Vec<&Received>> = HashMap::new();
    let mut roots = Vec::new();
    for s in spans {
        let parent = s.span.parent_span_id.as_slice();
        if ids.contains(&parent) {
            children.entry(parent).or_default().push(s);
        } else {
            roots.push(*s);
        }
    }
    let mut out = String::new();
    roots.sort_by_key(|s| s.span.start_time_unix_nano);
    for r in roots {
        write_node(&mut out, r, &children, 0);
    }
    out
}

fn write_node(
    out: &mut String,
    s: &Received,
    children: &HashMap<&[u8], Vec<&Received>>,
    depth: usize,
) {
    let status = match s.span.status.as_ref().map(|st| st.code) {
        Some(2) => " ERROR",
        _ => "",
    };
    let attributes: Vec<String> = s
        .span
        .attributes
        .iter()
        .filter(|kv| {
            (kv.key.starts_with("kvlease.") && kv.key != "kvlease.service")
                || kv.key == "rpc.grpc.status_code"
        })
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(AnyValue::ArrayValue(_)) => format!("{:?}", attr_ints(&s.span, &kv.key)),
                _ => "?".into(),
            };
            format!("{}={v}", kv.key.trim_start_matches("kvlease."))
        })
        .collect();
    let links = if s.span.links.is_empty() {
        String::new()
    } else {
        format!(" links={}", s.span.links.len())
    };
    out.push_str(&format!(
        "{}{} [{}]{status}{links} {}\n",
        "  ".repeat(depth),
        s.span.name,
        s.service,
        attributes.join(" ")
    ));
    let mut kids = children
        .get(s.span.span_id.as_slice())
        .cloned()
        .unwrap_or_default();
    kids.sort_by_key(|k| k.span.start_time_unix_nano);
    for k in kids {
        write_node(out, k, children, depth + 1);
    }
}
