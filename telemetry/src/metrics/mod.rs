//! A small Prometheus registry: counters, gauges and histograms, plain or with labels, rendered
//! in the text exposition format 0.0.4, and served by [`serve_metrics`].
//!
//! Handles are cheap clones over atomics; recording never locks (a labelled family locks once
//! per `with` lookup to find or create the child, so keep the child handle when labels are
//! fixed). Gauges that mirror state owned elsewhere (pool figures) are best set in the render
//! closure given to [`serve_metrics`], right before [`Registry::render`].

mod http;
pub mod names;
mod registry;

pub use self::http::{CONTENT_TYPE, serve_metrics};
pub use self::registry::{
    Counter, CounterVec, DEFAULT_LATENCY_BUCKETS, Gauge, GaugeVec, Histogram, HistogramVec,
    Registry,
};
