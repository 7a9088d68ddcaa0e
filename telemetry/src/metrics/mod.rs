//! Prometheus metrics on `prometheus-client`: a [`Registry`] that checks names and keeps a
//! catalog of what it registered ([`Registry::described`]), the names and labels every kvlease
//! service uses ([`names`]), and [`serve_metrics`] for `GET /metrics`.
//!
//! Handles are cheap clones over atomics; recording never locks (a labelled family takes a
//! read lock per `with` lookup to find the child, so keep the child handle when labels are
//! fixed). Gauges that mirror state owned elsewhere (pool figures) are best set in the render
//! closure given to [`serve_metrics`], right before [`Registry::render`].

mod http;
pub mod names;
mod registry;

pub use self::http::{CONTENT_TYPE, serve_metrics};
pub use self::registry::{
    Buckets, Counter, CounterVec, DEFAULT_LATENCY_BUCKETS, Described, Gauge, GaugeVec, Histogram,
    HistogramVec, Kind, Labelled, REQUEST_LATENCY_BUCKETS, Registry,
};
