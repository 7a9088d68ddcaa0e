//! What sits between the spans and the OTLP exporter: the step-trace sampler (a step's whole
//! trace is kept or dropped once its root says so, and no exported span keeps a link into a
//! dropped one) and the router that exports each logical
//! service's spans under its own resource (`service.name`, `service.version`,
//! `service.instance.id`), so that services sharing one process (`kvlease up`, tests) still
//! show up as separate services.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};

use crate::attributes::{SERVICE, SERVICE_INSTANCE, STEP_SAMPLED, STEP_SPAN};

// === StepSampler ===

/// Step traces held at once; beyond it the oldest is decided "keep" (exported, never lost
/// silently).
const OPEN_STEPS: usize = 1024;
/// Decisions remembered for spans that end after their step's root (an overlapped forward pass).
const DECIDED_STEPS: usize = 4096;

/// Holds the spans of each step trace (root span named [`STEP_SPAN`] without a parent) until
/// its root ends, then passes them all on when the root's [`STEP_SAMPLED`] attribute says why
/// (anything but `no`), or drops them all. Other spans pass through; one that links into a step
/// trace still open (a request's `Grant`, `Release` or worker `prefill`, linked to the batched
/// call that carried it) waits for that trace's decision, and loses its links into a dropped
/// one, so that no exported link points at a span that never was.
#[derive(Debug)]
pub(crate) struct StepSampler<P> {
    inner: P,
    state: Mutex<SamplerState>,
}

#[derive(Debug, Default)]
struct SamplerState {
    open: HashMap<TraceId, (SpanId, Vec<SpanData>)>,
    order: VecDeque<TraceId>,
    kept: HashSet<TraceId>,
    decided: VecDeque<TraceId>,
    dropped: HashSet<TraceId>,
    /// Spans of other traces that link into an open step trace, by that trace.
    waiting: HashMap<TraceId, Vec<SpanData>>,
}

impl SamplerState {
    /// `span`, of a trace that is not held, with its links into dropped step traces removed;
    /// `None` when it waits for an open step trace it links into.
    fn pass(&mut self, mut span: SpanData) -> Option<SpanData> {
        if span.links.links.is_empty() {
            return Some(span);
        }
        span.links
            .links
            .retain(|l| !self.dropped.contains(&l.span_context.trace_id()));
        let open = span
            .links
            .links
            .iter()
            .map(|l| l.span_context.trace_id())
            .find(|t| self.open.contains_key(t));
        match open {
            Some(trace) => {
                self.waiting.entry(trace).or_default().push(span);
                None
            }
            None => Some(span),
        }
    }
}

impl<P: SpanProcessor> StepSampler<P> {
    pub(crate) fn new(inner: P) -> Self {
        Self {
            inner,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, SamplerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn decide(&self, state: &mut SamplerState, trace: TraceId, keep: bool) -> Vec<SpanData> {
        let spans = state
            .open
            .remove(&trace)
            .map(|(_, s)| s)
            .unwrap_or_default();
        state.order.retain(|t| *t != trace);
        if keep {
            state.kept.insert(trace);
        } else {
            state.dropped.insert(trace);
        }
        state.decided.push_back(trace);
        while state.decided.len() > DECIDED_STEPS {
            if let Some(old) = state.decided.pop_front() {
                state.kept.remove(&old);
                state.dropped.remove(&old);
            }
        }
        let mut out = if keep { spans } else { Vec::new() };
        // the spans that waited for this decision: on their way, without their
        // links here if it dropped the trace (or waiting for another)
        for span in state.waiting.remove(&trace).unwrap_or_default() {
            out.extend(state.pass(span));
        }
        out
    }
}

impl<P: SpanProcessor> SpanProcessor for StepSampler<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        use opentelemetry::trace::{Span as _, TraceContextExt as _};
        if !cx.span().span_context().is_valid()
            && span.exported_data().is_some_and(|d| d.name == STEP_SPAN)
        {
            let sc = span.span_context();
            let mut state = self.state();
            state.open.insert(sc.trace_id(), (sc.span_id(), Vec::new()));
            state.order.push_back(sc.trace_id());
            let mut flush = Vec::new();
            while state.order.len() > OPEN_STEPS {
                if let Some(oldest) = state.order.pop_front() {
                    flush.extend(self.decide(&mut state, oldest, true));
                }
            }
            drop(state);
            for s in flush {
                self.inner.on_end(s);
            }
        }
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        let trace = span.span_context.trace_id();
        let mut state = self.state();
        let root = state.open.get(&trace).map(|(root, _)| *root);
        let out = match root {
            Some(root) if root == span.span_context.span_id() => {
                let keep = span
                    .attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == STEP_SAMPLED)
                    .is_some_and(|kv| kv.value.as_str() != "no");
                let mut spans = self.decide(&mut state, trace, keep);
                if keep {
                    spans.push(span);
                }
                spans
            }
            Some(_) => {
                if let Some((_, spans)) = state.open.get_mut(&trace) {
                    spans.push(span);
                }
                Vec::new()
            }
            None if state.dropped.contains(&trace) => Vec::new(),
            None => state.pass(span).into_iter().collect(),
        };
        drop(state);
        for s in out {
            self.inner.on_end(s);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

// === ServiceRouter ===

/// Exports each span through the processor of its logical service and instance (the
/// `kvlease.service` and `service.instance.id` span attributes), made on first use with that
/// service's resource by `make`.
pub(crate) struct ServiceRouter<P> {
    make: Box<dyn Fn(Resource) -> Option<P> + Send + Sync>,
    version: String,
    default_instance: String,
    routes: Mutex<HashMap<Route, Option<Arc<P>>>>,
}

/// A logical service and its instance.
type Route = (String, String);

impl<P> std::fmt::Debug for ServiceRouter<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceRouter")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl<P: SpanProcessor> ServiceRouter<P> {
    pub(crate) fn new(
        version: String,
        default_instance: String,
        make: impl Fn(Resource) -> Option<P> + Send + Sync + 'static,
    ) -> Self {
        Self {
            make: Box::new(make),
            version,
            default_instance,
            routes: Mutex::default(),
        }
    }

    fn route(&self, service: &str, instance: &str) -> Option<Arc<P>> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes
            .entry((service.to_owned(), instance.to_owned()))
            .or_insert_with(|| {
                let resource = resource(service, &self.version, instance);
                (self.make)(resource).map(Arc::new)
            })
            .clone()
    }

    fn all(&self) -> Vec<Arc<P>> {
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes.values().flatten().cloned().collect()
    }
}

/// The resource of one logical service instance.
pub(crate) fn resource(service: &str, version: &str, instance: &str) -> Resource {
    Resource::builder()
        .with_service_name(service.to_owned())
        .with_attributes([
            KeyValue::new("service.version", version.to_owned()),
            KeyValue::new("service.instance.id", instance.to_owned()),
        ])
        .build()
}

fn string_attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

impl<P: SpanProcessor> SpanProcessor for ServiceRouter<P> {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        let service = string_attr(&span, SERVICE).map(|v| v.as_str().into_owned());
        let instance = string_attr(&span, SERVICE_INSTANCE).map(|v| v.as_str().into_owned());
        let service = service.unwrap_or_default();
        let instance = instance.unwrap_or_else(|| self.default_instance.clone());
        if let Some(p) = self.route(&service, &instance) {
            p.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        for p in self.all() {
            p.force_flush()?;
        }
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let mut result = Ok(());
        for p in self.all() {
            if let Err(e) = p.shutdown_with_timeout(timeout) {
                result = Err(e);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SimpleSpanProcessor};

    /// A provider whose spans go through `processor`.
    fn provider(processor: impl SpanProcessor + 'static) -> SdkTracerProvider {
        SdkTracerProvider::builder()
            .with_span_processor(processor)
            .build()
    }

    fn names(exporter: &InMemorySpanExporter) -> Vec<String> {
        let mut names: Vec<String> = exporter
            .get_finished_spans()
            .unwrap_or_default()
            .into_iter()
            .map(|s| s.name.into_owned())
            .collect();
        names.sort();
        names
    }

    /// A step trace: root `step` (marked `why`), a child that ends before
    /// it and, when `late`, one that ends after it.
    fn step_trace(provider: &SdkTracerProvider, why: &'static str, late: bool) {
        use opentelemetry::trace::{Span as _, TraceContextExt as _};
        let tracer = provider.tracer("test");
        let mut root = tracer.start(STEP_SPAN);
        let cx = Context::new().with_remote_span_context(root.span_context().clone());
        let mut early = tracer.start_with_context(format!("{why}-early"), &cx);
        early.end();
        let mut after = tracer.start_with_context(format!("{why}-late"), &cx);
        root.set_attribute(KeyValue::new(STEP_SAMPLED, why));
        root.end();
        if late {
            after.end();
        }
    }

    #[test]
    fn a_step_trace_is_kept_or_dropped_whole_and_other_spans_pass() {
        let exporter = InMemorySpanExporter::default();
        let provider = provider(StepSampler::new(SimpleSpanProcessor::new(exporter.clone())));
        step_trace(&provider, "no", true);
        step_trace(&provider, "reject", true);
        let tracer = provider.tracer("test");
        drop(tracer.start("Generate"));
        assert_eq!(
            names(&exporter),
            ["Generate", "reject-early", "reject-late", "step"],
            "the unsampled step's spans, late ones too, are dropped"
        );
    }

    /// The links of each exported span named `name`, as the names of the traces' roots they
    /// point into (`step-no`, `step-reject`), by the trace ids in `roots`.
    fn linked(
        exporter: &InMemorySpanExporter,
        name: &str,
        roots: &[(opentelemetry::trace::TraceId, &str)],
    ) -> Vec<Vec<String>> {
        exporter
            .get_finished_spans()
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.name == name)
            .map(|s| {
                s.links
                    .links
                    .iter()
                    .map(|l| {
                        roots
                            .iter()
                            .find(|(t, _)| *t == l.span_context.trace_id())
                            .map_or("?".to_owned(), |(_, n)| (*n).to_owned())
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_span_linked_into_a_step_trace_waits_for_it_and_keeps_the_link_only_if_it_is_kept() {
        use opentelemetry::trace::{Link, Span as _, TraceContextExt as _};
        let exporter = InMemorySpanExporter::default();
        let provider = provider(StepSampler::new(SimpleSpanProcessor::new(exporter.clone())));
        let tracer = provider.tracer("test");
        let mut roots = Vec::new();
        for why in ["no", "reject"] {
            let mut step = tracer.start(STEP_SPAN);
            let cx = Context::new().with_remote_span_context(step.span_context().clone());
            let mut call = tracer.start_with_context("call", &cx);
            roots.push((step.span_context().trace_id(), why));
            // a request's span, linked to the step's call, ends before the step
            let mut grant = tracer
                .span_builder(format!("grant-{why}"))
                .with_links(vec![Link::with_context(call.span_context().clone())])
                .start(&tracer);
            grant.end();
            assert!(
                !names(&exporter).contains(&format!("grant-{why}")),
                "a span linked into an open step trace waits for its decision"
            );
            call.end();
            step.set_attribute(KeyValue::new(STEP_SAMPLED, why));
            step.end();
        }
        // a span that links into an already dropped step trace
        let dropped = opentelemetry::trace::SpanContext::new(
            roots[0].0,
            opentelemetry::trace::SpanId::from(7),
            opentelemetry::trace::TraceFlags::SAMPLED,
            false,
            Default::default(),
        );
        let mut late = tracer
            .span_builder("grant-late")
            .with_links(vec![Link::with_context(dropped)])
            .start(&tracer);
        late.end();
        assert_eq!(
            names(&exporter),
            ["call", "grant-late", "grant-no", "grant-reject", "step"],
            "requests' spans are all exported; the dropped step is not"
        );
        let none: Vec<Vec<String>> = vec![vec![]];
        assert_eq!(
            linked(&exporter, "grant-no", &roots),
            none,
            "link into a dropped step"
        );
        assert_eq!(
            linked(&exporter, "grant-late", &roots),
            none,
            "link into a dropped step"
        );
        assert_eq!(
            linked(&exporter, "grant-reject", &roots),
            [["reject".to_owned()]],
            "a link into a kept step stays"
        );
    }

    #[test]
    fn each_logical_service_is_exported_under_its_own_resource() {
        use opentelemetry::trace::Span as _;
        let exporter = InMemorySpanExporter::default();
        let made: Arc<Mutex<Vec<Resource>>> = Arc::default();
        let router = {
            let (exporter, made) = (exporter.clone(), Arc::clone(&made));
            ServiceRouter::new("1.2.3".into(), "pid-1".into(), move |resource| {
                made.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(resource);
                Some(SimpleSpanProcessor::new(exporter.clone()))
            })
        };
        let provider = provider(router);
        let tracer = provider.tracer("test");
        for (service, instance) in [
            ("kvlease-cache", None),
            ("kvlease-worker", Some("127.0.0.1:1")),
            ("kvlease-worker", Some("127.0.0.1:2")),
            ("kvlease-cache", None),
        ] {
            let mut span = tracer.start("call");
            span.set_attribute(KeyValue::new(SERVICE, service));
            if let Some(instance) = instance {
                span.set_attribute(KeyValue::new(SERVICE_INSTANCE, instance));
            }
            span.end();
        }
        let made = made.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let described: Vec<(String, String, String)> = made
            .iter()
            .map(|r| {
                let get = |key: &'static str| {
                    r.get(&opentelemetry::Key::from_static_str(key))
                        .map(|v| v.as_str().into_owned())
                        .unwrap_or_default()
                };
                (
                    get("service.name"),
                    get("service.instance.id"),
                    get("service.version"),
                )
            })
            .collect();
        assert_eq!(
            described,
            [
                ("kvlease-cache".into(), "pid-1".into(), "1.2.3".into()),
                (
                    "kvlease-worker".into(),
                    "127.0.0.1:1".into(),
                    "1.2.3".into()
                ),
                (
                    "kvlease-worker".into(),
                    "127.0.0.1:2".into(),
                    "1.2.3".into()
                ),
            ],
            "one processor per service and instance, made once"
        );
        assert_eq!(names(&exporter).len(), 4);
    }
}
