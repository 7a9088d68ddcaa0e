//! The registry and its metric types.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::{Error, Result};

/// Latency buckets in seconds, 100 µs to 10 s: a decode step on CPU is milliseconds, a cold
/// prefill can take seconds.
pub const DEFAULT_LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// A set of metric families rendered together, in registration order.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    families: Arc<Mutex<Vec<Family>>>,
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: &'static str,
    label_names: Vec<&'static str>,
    children: Arc<Mutex<BTreeMap<Vec<String>, Child>>>,
}

#[derive(Debug, Clone)]
enum Child {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A counter without labels. Name it `..._total`.
    pub fn counter(&self, name: &str, help: &str) -> Result<Counter> {
        let family = self.register(name, help, "counter", &[])?;
        Ok(family
            .get_or_insert(&[], || Child::Counter(Counter::default()))
            .into_counter())
    }

    /// A counter family with labels `label_names`.
    pub fn counter_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
    ) -> Result<CounterVec<N>> {
        Ok(CounterVec {
            family: self.register(name, help, "counter", &label_names)?,
        })
    }

    /// A gauge without labels.
    pub fn gauge(&self, name: &str, help: &str) -> Result<Gauge> {
        let family = self.register(name, help, "gauge", &[])?;
        Ok(family
            .get_or_insert(&[], || Child::Gauge(Gauge::default()))
            .into_gauge())
    }

    /// A gauge family with labels `label_names`.
    pub fn gauge_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
    ) -> Result<GaugeVec<N>> {
        Ok(GaugeVec {
            family: self.register(name, help, "gauge", &label_names)?,
        })
    }

    /// A histogram without labels over the upper bounds `buckets` (sorted, finite; `+Inf` is
    /// implied). Name it after its unit, e.g. `..._seconds`.
    pub fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Result<Histogram> {
        let buckets = check_buckets(name, buckets)?;
        let family = self.register(name, help, "histogram", &[])?;
        Ok(family
            .get_or_insert(&[], || Child::Histogram(Histogram::new(buckets)))
            .into_histogram())
    }

    /// A histogram family with labels `label_names`.
    pub fn histogram_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
        buckets: &[f64],
    ) -> Result<HistogramVec<N>> {
        let buckets = check_buckets(name, buckets)?;
        Ok(HistogramVec {
            family: self.register(name, help, "histogram", &label_names)?,
            buckets: Arc::from(buckets),
        })
    }

    /// Every family in the Prometheus text format 0.0.4.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let families = self.families.lock().unwrap_or_else(PoisonError::into_inner);
        for family in families.iter() {
            family.render(&mut out);
        }
        out
    }

    fn register(
        &self,
        name: &str,
        help: &str,
        kind: &'static str,
        label_names: &[&'static str],
    ) -> Result<FamilyHandle> {
        if !is_metric_name(name) {
            return Err(Error::InvalidMetricName(name.to_owned()));
        }
        if let Some(bad) = label_names.iter().find(|l| !is_label_name(l)) {
            return Err(Error::InvalidMetricName((*bad).to_owned()));
        }
        let mut families = self.families.lock().unwrap_or_else(PoisonError::into_inner);
        if families.iter().any(|f| f.name == name) {
            return Err(Error::DuplicateMetric(name.to_owned()));
        }
        let children = Arc::new(Mutex::new(BTreeMap::new()));
        families.push(Family {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            label_names: label_names.to_vec(),
            children: Arc::clone(&children),
        });
        Ok(FamilyHandle { children })
    }
}

/// The children of one family, shared between the registry and a `...Vec` handle.
#[derive(Debug, Clone)]
struct FamilyHandle {
    children: Arc<Mutex<BTreeMap<Vec<String>, Child>>>,
}

impl FamilyHandle {
    fn get_or_insert(&self, values: &[&str], make: impl FnOnce() -> Child) -> Child {
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let mut children = self.children.lock().unwrap_or_else(PoisonError::into_inner);
        children.entry(key).or_insert_with(make).clone()
    }
}

impl Child {
    // The family's kind fixes the child's variant, so the other arms cannot be reached; they
    // return a detached metric rather than panic.
    fn into_counter(self) -> Counter {
        match self {
            Child::Counter(c) => c,
            _ => Counter::default(),
        }
    }

    fn into_gauge(self) -> Gauge {
        match self {
            Child::Gauge(g) => g,
            _ => Gauge::default(),
        }
    }

    fn into_histogram(self) -> Histogram {
        match self {
            Child::Histogram(h) => h,
            _ => Histogram::new(Vec::new()),
        }
    }
}

// === metric types ===

/// A monotonically increasing count.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.inc_by(1);
    }

    /// Adds `n`.
    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (stored as `f64` bits).
#[derive(Debug, Clone)]
pub struct Gauge(Arc<AtomicU64>);

impl Default for Gauge {
    fn default() -> Self {
        Self(Arc::new(AtomicU64::new(0f64.to_bits())))
    }
}

impl Gauge {
    /// Sets the value.
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    /// Adds `delta` (negative to subtract).
    pub fn add(&self, delta: f64) {
        add_f64(&self.0, delta);
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Observations counted into cumulative buckets, with their sum and count.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    upper_bounds: Vec<f64>,
    // Per bucket (not cumulative), plus one for +Inf.
    counts: Vec<AtomicU64>,
    sum: AtomicU64,
}

impl Histogram {
    fn new(upper_bounds: Vec<f64>) -> Self {
        let counts = (0..=upper_bounds.len())
            .map(|_| AtomicU64::new(0))
            .collect();
        Self(Arc::new(HistogramInner {
            upper_bounds,
            counts,
            sum: AtomicU64::new(0f64.to_bits()),
        }))
    }

    /// Records one observation.
    pub fn observe(&self, value: f64) {
        let inner = &self.0;
        let bucket = inner.upper_bounds.partition_point(|bound| *bound < value);
        if let Some(count) = inner.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        add_f64(&inner.sum, value);
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// Number of observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Sum of observations so far.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.0.sum.load(Ordering::Relaxed))
    }
}

/// A counter family; `with(["POOL_EXHAUSTED"])` gives the child for those label values.
#[derive(Debug, Clone)]
pub struct CounterVec<const N: usize> {
    family: FamilyHandle,
}

impl<const N: usize> CounterVec<N> {
    /// The counter for these label values (created at zero on first use).
    pub fn with(&self, values: [&str; N]) -> Counter {
        self.family
            .get_or_insert(&values, || Child::Counter(Counter::default()))
            .into_counter()
    }
}

/// A gauge family.
#[derive(Debug, Clone)]
pub struct GaugeVec<const N: usize> {
    family: FamilyHandle,
}

impl<const N: usize> GaugeVec<N> {
    /// The gauge for these label values (created at zero on first use).
    pub fn with(&self, values: [&str; N]) -> Gauge {
        self.family
            .get_or_insert(&values, || Child::Gauge(Gauge::default()))
            .into_gauge()
    }
}

/// A histogram family.
#[derive(Debug, Clone)]
pub struct HistogramVec<const N: usize> {
    family: FamilyHandle,
    buckets: Arc<[f64]>,
}

impl<const N: usize> HistogramVec<N> {
    /// The histogram for these label values (created empty on first use).
    pub fn with(&self, values: [&str; N]) -> Histogram {
        let buckets = &self.buckets;
        self.family
            .get_or_insert(&values, || {
                Child::Histogram(Histogram::new(buckets.to_vec()))
            })
            .into_histogram()
    }
}

// === rendering ===

impl Family {
    fn render(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, escape_help(&self.help));
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        let children = self.children.lock().unwrap_or_else(PoisonError::into_inner);
        for (values, child) in children.iter() {
            let labels = render_labels(&self.label_names, values, None);
            match child {
                Child::Counter(c) => {
                    let _ = writeln!(out, "{}{labels} {}", self.name, c.get());
                }
                Child::Gauge(g) => {
                    let _ = writeln!(out, "{}{labels} {}", self.name, fmt_f64(g.get()));
                }
                Child::Histogram(h) => self.render_histogram(out, values, h),
            }
        }
    }

    fn render_histogram(&self, out: &mut String, values: &[String], h: &Histogram) {
        let mut cumulative = 0u64;
        let bounds =
            h.0.upper_bounds
                .iter()
                .copied()
                .chain(std::iter::once(f64::INFINITY));
        for (bound, count) in bounds.zip(h.0.counts.iter()) {
            cumulative += count.load(Ordering::Relaxed);
            let le = fmt_f64(bound);
            let labels = render_labels(&self.label_names, values, Some(&le));
            let _ = writeln!(out, "{}_bucket{labels} {cumulative}", self.name);
        }
        let labels = render_labels(&self.label_names, values, None);
        let _ = writeln!(out, "{}_sum{labels} {}", self.name, fmt_f64(h.sum()));
        // The +Inf bucket's cumulative count, so that count and buckets agree even while
        // observations race with the render.
        let _ = writeln!(out, "{}_count{labels} {cumulative}", self.name);
    }
}

fn render_labels(names: &[&'static str], values: &[String], le: Option<&str>) -> String {
    let mut pairs: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(name, value)| format!("{name}=\"{}\"", escape_label_value(value)))
        .collect();
    if let Some(le) = le {
        pairs.push(format!("le=\"{le}\""));
    }
    if pairs.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", pairs.join(","))
    }
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn fmt_f64(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value == f64::INFINITY {
        "+Inf".to_owned()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{value}")
    }
}

fn add_f64(cell: &AtomicU64, delta: f64) {
    let mut current = cell.load(Ordering::Relaxed);
    loop {
        let next = (f64::from_bits(current) + delta).to_bits();
        match cell.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => current = actual,
        }
    }
}

fn check_buckets(name: &str, buckets: &[f64]) -> Result<Vec<f64>> {
    let sorted = buckets.windows(2).all(|w| w[0] < w[1]);
    if buckets.is_empty() || !sorted || buckets.iter().any(|b| !b.is_finite()) {
        return Err(Error::InvalidBuckets(name.to_owned()));
    }
    Ok(buckets.to_vec())
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    name != "le"
        && !name.starts_with("__")
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms_in_text_format() -> Result<()> {
        let registry = Registry::new();
        let grants = registry.counter("kvlease_grants_total", "Sequences granted.")?;
        let rejects =
            registry.counter_vec("kvlease_rejects_total", "Rejects by reason.", ["reason"])?;
        let blocks = registry.gauge_vec(
            "kvlease_pool_blocks",
            "Blocks by state.",
            ["pool_id", "state"],
        )?;
        let step = registry.histogram("kvlease_step_seconds", "Step latency.", &[0.01, 0.1])?;

        grants.inc_by(3);
        rejects.with(["POOL_EXHAUSTED"]).inc();
        rejects.with(["POOL_EXHAUSTED"]).inc();
        rejects.with(["EXCEEDS_CAPACITY"]).inc();
        blocks.with(["0", "free"]).set(12.0);
        blocks.with(["0", "in_use"]).set(4.5);
        step.observe(0.005);
        step.observe(0.05);
        step.observe(3.0);

        let text = registry.render();
        let expected = "\
# HELP kvlease_grants_total Sequences granted.
# TYPE kvlease_grants_total counter
kvlease_grants_total 3
# HELP kvlease_rejects_total Rejects by reason.
# TYPE kvlease_rejects_total counter
kvlease_rejects_total{reason=\"EXCEEDS_CAPACITY\"} 1
kvlease_rejects_total{reason=\"POOL_EXHAUSTED\"} 2
# HELP kvlease_pool_blocks Blocks by state.
# TYPE kvlease_pool_blocks gauge
kvlease_pool_blocks{pool_id=\"0\",state=\"free\"} 12
kvlease_pool_blocks{pool_id=\"0\",state=\"in_use\"} 4.5
# HELP kvlease_step_seconds Step latency.
# TYPE kvlease_step_seconds histogram
kvlease_step_seconds_bucket{le=\"0.01\"} 1
kvlease_step_seconds_bucket{le=\"0.1\"} 2
kvlease_step_seconds_bucket{le=\"+Inf\"} 3
kvlease_step_seconds_sum 3.055
kvlease_step_seconds_count 3
";
        assert_eq!(text, expected);
        Ok(())
    }

    #[test]
    fn observations_on_a_bound_fall_in_that_bucket() -> Result<()> {
        let registry = Registry::new();
        let h = registry.histogram_vec("lat_seconds", "x", ["op"], &[1.0, 2.0])?;
        h.with(["a"]).observe(1.0);
        h.with(["a"]).observe(2.5);
        let text = registry.render();
        assert!(
            text.contains("lat_seconds_bucket{op=\"a\",le=\"1\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{op=\"a\",le=\"2\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{op=\"a\",le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert_eq!(h.with(["a"]).count(), 2);
        Ok(())
    }

    #[test]
    fn label_values_and_help_are_escaped() -> Result<()> {
        let registry = Registry::new();
        let g = registry.gauge_vec("g", "line one\nline \\two", ["v"])?;
        g.with(["a\"b\\c\nd"]).add(-2.0);
        let text = registry.render();
        assert!(
            text.contains("# HELP g line one\\nline \\\\two\n"),
            "{text}"
        );
        assert!(text.contains("g{v=\"a\\\"b\\\\c\\nd\"} -2\n"), "{text}");
        Ok(())
    }

    #[test]
    fn bad_names_duplicates_and_buckets_are_refused() {
        let registry = Registry::new();
        assert!(matches!(
            registry.counter("1abc", ""),
            Err(Error::InvalidMetricName(_))
        ));
        assert!(matches!(
            registry.counter_vec("ok", "", ["le"]),
            Err(Error::InvalidMetricName(_))
        ));
        assert!(registry.gauge("dup", "").is_ok());
        assert!(matches!(
            registry.counter("dup", ""),
            Err(Error::DuplicateMetric(_))
        ));
        assert!(matches!(
            registry.histogram("h", "", &[2.0, 1.0]),
            Err(Error::InvalidBuckets(_))
        ));
        assert!(matches!(
            registry.histogram("h2", "", &[]),
            Err(Error::InvalidBuckets(_))
        ));
    }

    #[test]
    fn gauge_add_is_exact_under_concurrency() {
        let gauge = Gauge::default();
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| (0..1000).for_each(|_| gauge.add(1.0)));
            }
        });
        assert_eq!(gauge.get(), 4000.0);
    }
}
