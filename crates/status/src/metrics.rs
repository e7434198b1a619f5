//! `GET /metrics`: the process's counters for a Prometheus server (or any scraper) to read.
//!
//! Why it is built at scrape time: every rserpool process already keeps its counters where its
//! hot path wants them (the registrar's core, the proxy's per-PE atomics), so a scrape reads a
//! snapshot of those into an [`Exposition`]. Nothing is registered ahead, so there are no
//! metric handles to keep in step with pools and PEs that come and go.
//!
//! Two formats, chosen by the scraper's `Accept` header ([`Format::negotiate`]): OpenMetrics
//! (written by `prometheus-client`: `_total` on counter samples only, `# EOF`) when it asks for
//! it, as Prometheus does; otherwise the Prometheus text format 0.0.4, which `promtool check
//! metrics` and many other scrapers read, and which `prometheus-client` does not write (here,
//! [`Exposition::encode_text`]).
//!
//! Latencies are kept in a [`LatencyHistogram`]: lock-free buckets on the hot path.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The content type of [`Exposition::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of [`Exposition::encode_text`]'s text.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The formats a scrape is answered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    /// The Prometheus text format, version 0.0.4.
    Text,
}

impl Format {
    /// The format for a request whose `Accept` header is `accept`: OpenMetrics if it asks for
    /// `application/openmetrics-text` with a quality no lower than any `text/plain` it names
    /// (Prometheus sends both, OpenMetrics preferred); otherwise the text format, also when
    /// it names neither or sends no header.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let mut open = None::<f32>;
        let mut text = None::<f32>;
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, v)| v.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            let best = match media.as_str() {
                "application/openmetrics-text" => &mut open,
                "text/plain" => &mut text,
                _ => continue,
            };
            *best = Some(best.map_or(q, |b| b.max(q)));
        }
        match open {
            Some(o) if o > 0.0 && text.is_none_or(|t| o >= t) => Format::OpenMetrics,
            _ => Format::Text,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => CONTENT_TYPE,
            Format::Text => TEXT_CONTENT_TYPE,
        }
    }
}

/// The metric families of one scrape, in the order first added.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Exposition {
    families: Vec<Family>,
}

#[derive(Debug, Clone, PartialEq)]
struct Family {
    name: String,
    help: String,
    kind: Kind,
    samples: Vec<(Labels, Value)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

type Labels = Vec<(String, String)>;

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(u64),
    /// A counter of a quantity that is not whole (CPU seconds).
    Seconds(f64),
    Float(f64),
    Histogram(HistogramSnapshot),
}

/// A histogram as read at one moment: per-bucket counts (not cumulative), their upper bounds,
/// the sum and the count.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
}

impl Exposition {
    /// A counter sample; `name` without `_total` (the encoder adds it).
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.add(name, help, Kind::Counter, labels, Value::Int(value));
    }

    /// A counter of seconds (or another quantity that is not whole); `name` without `_total`.
    pub fn counter_f64(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.add(name, help, Kind::Counter, labels, Value::Seconds(value));
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.add(name, help, Kind::Gauge, labels, Value::Float(value));
    }

    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: HistogramSnapshot,
    ) {
        let value = Value::Histogram(value);
        self.add(name, help, Kind::Histogram, labels, value);
    }

    fn add(&mut self, name: &str, help: &str, kind: Kind, labels: &[(&str, &str)], value: Value) {
        let labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        // Families are few (tens); a scan beats a map here.
        match self.families.iter_mut().find(|f| f.name == name) {
            Some(f) => f.samples.push((labels, value)),
            None => self.families.push(Family {
                name: name.to_owned(),
                help: help.to_owned(),
                kind,
                samples: vec![(labels, value)],
            }),
        }
    }

    /// The text of a scrape in `format`.
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.clone().encode(),
            Format::Text => self.encode_text(),
        }
    }

    /// The Prometheus text format 0.0.4: `# HELP` and `# TYPE` for every family, named as its
    /// samples are (a counter's with `_total`), cumulative histogram buckets with `le` last.
    pub fn encode_text(&self) -> String {
        let mut out = String::new();
        for f in &self.families {
            let (name, kind) = match f.kind {
                Kind::Counter => (format!("{}_total", f.name), "counter"),
                Kind::Gauge => (f.name.clone(), "gauge"),
                Kind::Histogram => (f.name.clone(), "histogram"),
            };
            let _ = writeln!(out, "# HELP {name} {}", escape(&f.help, false));
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in &f.samples {
                match value {
                    Value::Int(v) => text_sample(&mut out, &name, labels, None, &v.to_string()),
                    Value::Seconds(v) | Value::Float(v) => {
                        text_sample(&mut out, &name, labels, None, &text_float(*v));
                    }
                    Value::Histogram(h) => {
                        let bucket = format!("{name}_bucket");
                        let mut below = 0u64;
                        for (le, n) in &h.buckets {
                            below += n;
                            let le = text_float(*le);
                            text_sample(&mut out, &bucket, labels, Some(&le), &below.to_string());
                        }
                        let sum = text_float(h.sum);
                        text_sample(&mut out, &format!("{name}_sum"), labels, None, &sum);
                        let count = h.count.to_string();
                        text_sample(&mut out, &format!("{name}_count"), labels, None, &count);
                    }
                }
            }
        }
        out
    }

    /// The text a scrape gets in OpenMetrics.
    pub fn encode(self) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        // Writing to a String does not fail, and every family is well-formed by construction.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
            out = format!("# cannot encode the metrics: {e}\n# EOF\n");
        }
        out
    }
}

/// One sample line of the text format.
fn text_sample(out: &mut String, name: &str, labels: &Labels, le: Option<&str>, value: &str) {
    out.push_str(name);
    let le = le.map(|v| ("le", v));
    let all = labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(le);
    for (i, (k, v)) in all.enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        let _ = write!(out, "{k}=\"{}\"", escape(v, true));
    }
    if !labels.is_empty() || le.is_some() {
        out.push('}');
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
}

/// A value as the text format writes it (Go's float syntax: `+Inf`, `-Inf`, `NaN`).
fn text_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        v.to_string()
    }
}

/// Escapes a help text (backslash, newline) or a label value (also the double quote).
fn escape(s: &str, quote: bool) -> std::borrow::Cow<'_, str> {
    let special = |c: char| c == '\\' || c == '\n' || (quote && c == '"');
    if !s.contains(special) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out.into()
}

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.families {
            let kind = match f.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
                Kind::Histogram => MetricType::Histogram,
            };
            let mut metric = encoder.encode_descriptor(&f.name, &f.help, None, kind)?;
            match f.samples.as_slice() {
                // Without labels (an empty label set would still write braces).
                [(labels, value)] if labels.is_empty() => encode_value(value, metric)?,
                samples => {
                    for (labels, value) in samples {
                        encode_value(value, metric.encode_family(labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn encode_value(value: &Value, mut m: MetricEncoder) -> Result<(), std::fmt::Error> {
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::gauge::ConstGauge;
    match value {
        Value::Int(v) => ConstCounter::new(*v).encode(m),
        Value::Seconds(v) => ConstCounter::new(*v).encode(m),
        Value::Float(v) => ConstGauge::new(*v).encode(m),
        Value::Histogram(h) => m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            h.sum, h.count, &h.buckets, None,
        ),
    }
}

/// Upper bounds of [`LatencyHistogram`]'s buckets, seconds (and +Inf).
pub const LATENCY_BOUNDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A latency histogram updated without a lock: one atomic per bucket, the sum in µs.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// The buckets of [`LATENCY_BOUNDS`], then +Inf.
    counts: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS.partition_point(|b| *b < s);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(
            d.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let bounds = LATENCY_BOUNDS.iter().copied().chain([f64::INFINITY]);
        let buckets: Vec<(f64, u64)> = bounds
            .zip(&self.counts)
            .map(|(b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        HistogramSnapshot {
            count: buckets.iter().map(|(_, c)| c).sum(),
            buckets,
            sum: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// The process's own metrics, as Prometheus's client libraries name them: CPU seconds, resident
/// and virtual memory, open file descriptors and the start time (Linux; elsewhere none).
pub fn process(m: &mut Exposition) {
    let Some(p) = ProcessStat::read() else {
        return;
    };
    m.counter_f64(
        "process_cpu_seconds",
        "User and system CPU time spent, seconds.",
        &[],
        p.cpu_seconds,
    );
    m.gauge(
        "process_resident_memory_bytes",
        "Resident memory size, bytes.",
        &[],
        p.rss_bytes as f64,
    );
    m.gauge(
        "process_virtual_memory_bytes",
        "Virtual memory size, bytes.",
        &[],
        p.vsize_bytes as f64,
    );
    if let Some(fds) = p.open_fds {
        m.gauge(
            "process_open_fds",
            "Open file descriptors.",
            &[],
            fds as f64,
        );
    }
    if let Some(start) = p.start_time_seconds {
        m.gauge(
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch, seconds.",
            &[],
            start,
        );
    }
}

struct ProcessStat {
    cpu_seconds: f64,
    rss_bytes: u64,
    vsize_bytes: u64,
    open_fds: Option<usize>,
    start_time_seconds: Option<f64>,
}

impl ProcessStat {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The fields after the command name (which may hold spaces and parentheses).
        let (_, rest) = stat.rsplit_once(')')?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        // Numbered as in proc(5), from field 3 (state) at index 0.
        let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let ticks = rustix::param::clock_ticks_per_second().max(1) as f64;
        let page = rustix::param::page_size() as u64;
        let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        Some(Self {
            cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
            vsize_bytes: field(23)?,
            rss_bytes: field(24)? * page,
            open_fds: std::fs::read_dir("/proc/self/fd").ok().map(Iterator::count),
            start_time_seconds: boot
                .zip(field(22))
                .map(|(b, start)| b as f64 + start as f64 / ticks),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_group_their_samples_and_counters_get_total() {
        let mut m = Exposition::default();
        m.counter("rserpool_requests", "Requests.", &[("pool", "a")], 3);
        m.gauge("rserpool_pool_elements", "PEs.", &[], 2.0);
        m.counter("rserpool_requests", "Requests.", &[("pool", "b\"x")], 4);
        let text = m.encode();
        assert!(
            text.contains("# TYPE rserpool_requests counter\n"),
            "{text}"
        );
        assert!(
            text.contains("rserpool_requests_total{pool=\"a\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("rserpool_requests_total{pool=\"b\\\"x\"} 4\n"),
            "{text}"
        );
        assert!(text.contains("rserpool_pool_elements 2.0\n"), "{text}");
        assert_eq!(text.matches("# TYPE rserpool_requests ").count(), 1);
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn the_scraper_chooses_the_format() {
        use Format::*;
        for (accept, want) in [
            (None, Text),
            (Some("*/*"), Text),
            (Some("text/plain;version=0.0.4"), Text),
            // Prometheus's own.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0;q=0.5,\
                     application/openmetrics-text;version=0.0.1;q=0.4,\
                     text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                ),
                OpenMetrics,
            ),
            (
                Some("Application/OpenMetrics-Text; version=1.0.0"),
                OpenMetrics,
            ),
            (Some("application/openmetrics-text;q=0"), Text),
            (
                Some("application/openmetrics-text;q=0.2, text/plain;q=0.9"),
                Text,
            ),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn the_text_format_names_every_family_as_its_samples() {
        let mut m = Exposition::default();
        m.counter(
            "rserpool_requests",
            "Requests\\ \n served.",
            &[("pool", "a")],
            3,
        );
        m.counter("rserpool_requests", "", &[("pool", "b\"x\n")], 4);
        m.gauge("rserpool_pool_elements", "PEs.", &[], 2.0);
        m.gauge("rserpool_weird", "Inf.", &[], f64::INFINITY);
        let h = LatencyHistogram::default();
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(3));
        m.histogram(
            "rserpool_latency_seconds",
            "L.",
            &[("pe", "1")],
            h.snapshot(),
        );
        let text = m.encode_as(Format::Text);
        let want = [
            "# HELP rserpool_requests_total Requests\\\\ \\n served.\n",
            "# TYPE rserpool_requests_total counter\n",
            "rserpool_requests_total{pool=\"a\"} 3\n",
            "rserpool_requests_total{pool=\"b\\\"x\\n\"} 4\n",
            "# TYPE rserpool_pool_elements gauge\nrserpool_pool_elements 2\n",
            "rserpool_weird +Inf\n",
            "# TYPE rserpool_latency_seconds histogram\n",
            "rserpool_latency_seconds_bucket{pe=\"1\",le=\"0.0005\"} 1\n",
            "rserpool_latency_seconds_bucket{pe=\"1\",le=\"0.005\"} 2\n",
            "rserpool_latency_seconds_bucket{pe=\"1\",le=\"+Inf\"} 2\n",
            "rserpool_latency_seconds_sum{pe=\"1\"} 0.0033\n",
            "rserpool_latency_seconds_count{pe=\"1\"} 2\n",
        ];
        for w in want {
            assert!(text.contains(w), "{w:?} not in\n{text}");
        }
        assert_eq!(text.matches("# HELP ").count(), 4);
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn the_latency_histogram_counts_into_its_bucket_and_cumulates_on_the_wire() {
        let h = LatencyHistogram::default();
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(60));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert!((s.sum - 60.0033).abs() < 1e-9, "{}", s.sum);
        assert_eq!(s.buckets[0], (0.0005, 1));
        assert_eq!(s.buckets[3], (0.005, 1));
        assert_eq!(s.buckets.last(), Some(&(f64::INFINITY, 1)));
        let mut m = Exposition::default();
        m.histogram("rserpool_latency_seconds", "L.", &[("pe", "1")], s);
        let text = m.encode();
        assert!(
            text.contains("rserpool_latency_seconds_bucket{le=\"0.005\",pe=\"1\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("rserpool_latency_seconds_bucket{le=\"+Inf\",pe=\"1\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("rserpool_latency_seconds_count{pe=\"1\"} 3\n"),
            "{text}"
        );
    }

    #[test]
    fn the_process_reports_its_cpu_and_memory() {
        let mut m = Exposition::default();
        process(&mut m);
        let text = m.encode();
        assert!(text.contains("process_cpu_seconds_total "), "{text}");
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse::<f64>().ok());
        assert!(rss.is_some_and(|v| v > 1e6), "{text}");
        assert!(text.contains("process_start_time_seconds "), "{text}");
    }
}
