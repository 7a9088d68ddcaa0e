//! The registry: `prometheus-client` underneath, plus what kvlease asks of it on top: names
//! checked at registration (one family per name, counters named `..._total`), labelled families
//! addressed by label *values* in the order their names were declared, and a catalog of what
//! was registered, so that docs and dashboards can be checked against what a service exports.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::registry::Metric;

use crate::error::{Error, Result};

/// A monotonically increasing count (`inc`, `inc_by`, `get`).
pub type Counter = prometheus_client::metrics::counter::Counter;
/// A value that goes up and down (`set`, `get`).
pub type Gauge = prometheus_client::metrics::gauge::Gauge<f64, AtomicU64>;
/// Observations counted into cumulative buckets (`observe`).
pub type Histogram = prometheus_client::metrics::histogram::Histogram;

/// Latency buckets in seconds, 100 µs to 10 s: a decode step on CPU is milliseconds, a cold
/// prefill can take seconds.
pub const DEFAULT_LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Request-level buckets in seconds, 1 ms to 5 minutes: a whole generation on CPU under an
/// over-subscribed bench can queue for minutes.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// The kind of a registered family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A counter: exposed as `<name>` (which ends in `_total`).
    Counter,
    /// A gauge: exposed as `<name>`.
    Gauge,
    /// A histogram: exposed as `<name>_bucket`, `<name>_sum` and `<name>_count`.
    Histogram,
}

impl Kind {
    /// The `# TYPE` word.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// What was registered under one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    /// The family name as exposed (counters include `_total`).
    pub name: String,
    /// The family's kind.
    pub kind: Kind,
    /// The help text.
    pub help: String,
    /// The label names, in declaration order (`le` of histograms not included).
    pub labels: Vec<&'static str>,
}

impl Described {
    /// The series names a scrape shows for this family.
    pub fn series(&self) -> Vec<String> {
        match self.kind {
            Kind::Counter | Kind::Gauge => vec![self.name.clone()],
            Kind::Histogram => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|suffix| format!("{}{suffix}", self.name))
                .collect(),
        }
    }
}

/// A set of metric families rendered together, in registration order.
#[derive(Debug, Default)]
pub struct Registry {
    inner: prometheus_client::registry::Registry,
    described: Vec<Described>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A counter without labels. Name it `..._total`.
    pub fn counter(&mut self, name: &str, help: &str) -> Result<Counter> {
        let counter = Counter::default();
        self.register(name, help, Kind::Counter, &[], counter.clone())?;
        Ok(counter)
    }

    /// A counter family with labels `label_names`. Name it `..._total`.
    pub fn counter_vec<const N: usize>(
        &mut self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
    ) -> Result<CounterVec<N>> {
        let family = Labelled {
            names: label_names,
            family: Family::default(),
        };
        self.register(
            name,
            help,
            Kind::Counter,
            &label_names,
            family.family.clone(),
        )?;
        Ok(family)
    }

    /// A gauge without labels.
    pub fn gauge(&mut self, name: &str, help: &str) -> Result<Gauge> {
        let gauge = Gauge::default();
        self.register(name, help, Kind::Gauge, &[], gauge.clone())?;
        Ok(gauge)
    }

    /// A gauge family with labels `label_names`.
    pub fn gauge_vec<const N: usize>(
        &mut self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
    ) -> Result<GaugeVec<N>> {
        let family = Labelled {
            names: label_names,
            family: Family::default(),
        };
        self.register(name, help, Kind::Gauge, &label_names, family.family.clone())?;
        Ok(family)
    }

    /// A histogram without labels over the upper bounds `buckets` (sorted, finite; `+Inf` is
    /// implied). Name it after its unit, e.g. `..._seconds`.
    pub fn histogram(&mut self, name: &str, help: &str, buckets: &[f64]) -> Result<Histogram> {
        let histogram = Buckets::new(name, buckets)?.new_metric();
        self.register(name, help, Kind::Histogram, &[], histogram.clone())?;
        Ok(histogram)
    }

    /// A histogram family with labels `label_names`.
    pub fn histogram_vec<const N: usize>(
        &mut self,
        name: &str,
        help: &str,
        label_names: [&'static str; N],
        buckets: &[f64],
    ) -> Result<HistogramVec<N>> {
        let family = Labelled {
            names: label_names,
            family: Family::new_with_constructor(Buckets::new(name, buckets)?),
        };
        self.register(
            name,
            help,
            Kind::Histogram,
            &label_names,
            family.family.clone(),
        )?;
        Ok(family)
    }

    /// Every family in the Prometheus text format 0.0.4 (families without a series yet are
    /// left out).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.inner);
        out
    }

    /// What was registered, in registration order.
    pub fn described(&self) -> &[Described] {
        &self.described
    }

    fn register(
        &mut self,
        name: &str,
        help: &str,
        kind: Kind,
        label_names: &[&'static str],
        metric: impl Metric,
    ) -> Result<()> {
        if !is_metric_name(name) {
            return Err(Error::InvalidMetricName(name.to_owned()));
        }
        if let Some(bad) = label_names.iter().find(|l| !is_label_name(l)) {
            return Err(Error::InvalidMetricName((*bad).to_owned()));
        }
        if self.described.iter().any(|d| d.name == name) {
            return Err(Error::DuplicateMetric(name.to_owned()));
        }
        // prometheus-client appends `_total` to counters itself.
        let registered = match kind {
            Kind::Counter => name
                .strip_suffix("_total")
                .filter(|base| !base.is_empty())
                .ok_or_else(|| Error::InvalidMetricName(name.to_owned()))?,
            Kind::Gauge | Kind::Histogram => name,
        };
        // ... and ends the help text with a period itself.
        self.inner
            .register(registered, help.trim_end_matches('.'), metric);
        self.described.push(Described {
            name: name.to_owned(),
            kind,
            help: help.to_owned(),
            labels: label_names.to_vec(),
        });
        Ok(())
    }
}

/// One family's label set: `(name, value)` pairs in declaration order.
type Labels<const N: usize> = [(&'static str, String); N];

/// A labelled family; `with(["POOL_EXHAUSTED"])` gives the child for those label values.
#[derive(Debug, Clone)]
pub struct Labelled<const N: usize, M, C = fn() -> M> {
    names: [&'static str; N],
    family: Family<Labels<N>, M, C>,
}

/// A counter family.
pub type CounterVec<const N: usize> = Labelled<N, Counter>;
/// A gauge family.
pub type GaugeVec<const N: usize> = Labelled<N, Gauge>;
/// A histogram family.
pub type HistogramVec<const N: usize> = Labelled<N, Histogram, Buckets>;

impl<const N: usize, M: Clone, C: MetricConstructor<M>> Labelled<N, M, C> {
    /// The child for these label values (created empty on first use). Children are cheap
    /// clones over shared atomics: keep one when its labels are fixed.
    pub fn with(&self, values: [&str; N]) -> M {
        let labels: Labels<N> = std::array::from_fn(|i| (self.names[i], values[i].to_owned()));
        self.family.get_or_create_owned(&labels)
    }

    /// Drops the child for these label values: its series is no longer
    /// rendered (the thing it measured is gone). Returns whether it existed.
    pub fn remove(&self, values: [&str; N]) -> bool {
        let labels: Labels<N> = std::array::from_fn(|i| (self.names[i], values[i].to_owned()));
        self.family.remove(&labels)
    }
}

/// The upper bounds a histogram family builds its children with.
#[derive(Debug, Clone)]
pub struct Buckets(Arc<[f64]>);

impl Buckets {
    fn new(name: &str, buckets: &[f64]) -> Result<Self> {
        let sorted = buckets.windows(2).all(|w| w[0] < w[1]);
        if buckets.is_empty() || !sorted || buckets.iter().any(|b| !b.is_finite()) {
            return Err(Error::InvalidBuckets(name.to_owned()));
        }
        Ok(Self(Arc::from(buckets)))
    }
}

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
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
        let mut registry = Registry::new();
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
        blocks.with(["0", "in_use"]).set(4.5);
        step.observe(0.005);
        step.observe(0.05);
        step.observe(3.0);

        let text = registry.render();
        for line in [
            "# HELP kvlease_grants_total Sequences granted.\n",
            "# TYPE kvlease_grants_total counter\n",
            "kvlease_grants_total 3\n",
            "# TYPE kvlease_rejects_total counter\n",
            "kvlease_rejects_total{reason=\"POOL_EXHAUSTED\"} 2\n",
            "# TYPE kvlease_pool_blocks gauge\n",
            "kvlease_pool_blocks{pool_id=\"0\",state=\"in_use\"} 4.5\n",
            "# HELP kvlease_pool_blocks Blocks by state.\n",
            "# TYPE kvlease_step_seconds histogram\n",
            "kvlease_step_seconds_bucket{le=\"0.01\"} 1\n",
            "kvlease_step_seconds_bucket{le=\"0.1\"} 2\n",
            "kvlease_step_seconds_bucket{le=\"+Inf\"} 3\n",
            "kvlease_step_seconds_sum 3.055\n",
            "kvlease_step_seconds_count 3\n",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
        assert_eq!(rejects.with(["POOL_EXHAUSTED"]).get(), 2);
        Ok(())
    }

    #[test]
    fn labels_follow_their_declared_names_and_values_are_escaped() -> Result<()> {
        let mut registry = Registry::new();
        let g = registry.gauge_vec("g", "x", ["b_label", "a_label"])?;
        g.with(["first", "a\"b\\c\nd"]).set(-2.0);
        let text = registry.render();
        assert!(
            text.contains("g{b_label=\"first\",a_label=\"a\\\"b\\\\c\\nd\"} -2.0\n"),
            "{text}"
        );
        Ok(())
    }

    #[test]
    fn the_catalog_names_every_family_and_its_series() -> Result<()> {
        let mut registry = Registry::new();
        registry.counter_vec("a_total", "A.", ["op"])?;
        registry.histogram_vec("b_seconds", "B.", ["reason"], DEFAULT_LATENCY_BUCKETS)?;
        let d = registry.described();
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[0].kind, d[0].labels.clone()),
            (Kind::Counter, vec!["op"])
        );
        assert_eq!(d[0].series(), vec!["a_total"]);
        assert_eq!(
            d[1].series(),
            vec!["b_seconds_bucket", "b_seconds_sum", "b_seconds_count"]
        );
        Ok(())
    }

    #[test]
    fn bad_names_duplicates_and_buckets_are_refused() {
        let mut registry = Registry::new();
        assert!(matches!(
            registry.counter("1abc_total", ""),
            Err(Error::InvalidMetricName(_))
        ));
        assert!(matches!(
            registry.counter("no_suffix", ""),
            Err(Error::InvalidMetricName(_))
        ));
        assert!(matches!(
            registry.counter_vec("ok_total", "", ["le"]),
            Err(Error::InvalidMetricName(_))
        ));
        assert!(registry.gauge("dup", "").is_ok());
        assert!(matches!(
            registry.gauge("dup", ""),
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
}
