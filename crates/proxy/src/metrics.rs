//! The proxy's `GET /metrics`: its per-pool, per-PE and per-level counters, the kernel splice
//! and the tier (see `rserpool_status::metrics` for the formats).
//!
//! Cardinality: one series per PE of a pool the proxy serves, up to [`MAX_PE_SERIES`] in all
//! (past that, a pool's remaining PEs are summed under `pe="other"`); one per service level;
//! none per client or request.

use crate::Proxy;
use crate::balance::backend::Backend;
use crate::balance::outlier::EjectCause;
use crate::balance::pools::RESPONSE_CLASSES;
use rserpool_status::metrics::{Exposition, HistogramSnapshot};
use std::sync::atomic::{AtomicU64, Ordering};

/// PE series at most (across pools); the rest are summed per pool.
pub const MAX_PE_SERIES: usize = 1000;

impl Proxy {
    /// The metrics a scrape gets.
    pub fn metrics(&self) -> Exposition {
        let mut m = Exposition::default();
        m.gauge(
            "rserpool_proxy_registrar_reachable",
            "1 when a registrar answered the last pool refresh.",
            &[],
            f64::from(u8::from(self.inner.pools.registrar_reachable())),
        );
        m.gauge(
            "rserpool_proxy_active_connections",
            "Client connections open now.",
            &[],
            self.active_connections() as f64,
        );
        m.gauge(
            "rserpool_proxy_parked_connections",
            "Idle kept-alive client connections waiting without a task of their own (among the \
             active ones).",
            &[],
            self.parked_connections() as f64,
        );
        m.counter(
            "rserpool_proxy_tls_handshake_failures",
            "HTTPS clients whose TLS handshake failed or timed out.",
            &[],
            self.inner.tls_failures.load(Ordering::Relaxed),
        );
        for (code, n) in self.inner.rejected.counts() {
            m.counter(
                "rserpool_proxy_rejected_requests",
                "Requests the proxy answered itself before any pool took them, by status: \
                 malformed (400), no route (404), CONNECT (405), head too slow (408) or too \
                 large (414, 431), another HTTP version (505).",
                &[("code", &code.to_string())],
                n,
            );
        }
        m.counter(
            "rserpool_proxy_access_log_dropped_lines",
            "Access log lines dropped because the file did not keep up (a full or hung disk).",
            &[],
            crate::access_log::dropped(),
        );
        m.counter(
            "rserpool_proxy_http2_floods",
            "HTTP/2 client connections ended with GOAWAY ENHANCE_YOUR_CALM (resets, control \
             frames, header or CONTINUATION abuse beyond the [http2] limits).",
            &[],
            crate::http::h2::front::floods(),
        );
        let mut series = 0;
        for pool in self.inner.pools.all() {
            let handle = pool.handle.to_string();
            let backends = pool.backends();
            m.gauge(
                "rserpool_proxy_pool_elements",
                "PEs of the pool, as the registrar reported them.",
                &[("pool", &handle)],
                backends.len() as f64,
            );
            let (own, rest) = backends.split_at(backends.len().min(MAX_PE_SERIES - series));
            series += own.len();
            for b in own {
                pe_metrics(&mut m, &handle, &format!("{:#010x}", b.id), &[b.as_ref()]);
            }
            if !rest.is_empty() {
                let rest: Vec<&Backend> = rest.iter().map(AsRef::as_ref).collect();
                pe_metrics(&mut m, &handle, "other", &rest);
            }
            for l in pool.level_stats() {
                level_metrics(&mut m, &handle, &l, pool.counts_finished());
            }
            for (cause, n) in EjectCause::ALL.iter().zip(pool.ejections()) {
                m.counter(
                    "rserpool_proxy_pool_ejections",
                    "Ejections of the pool's PEs by cause, kept when a PE leaves the pool (its \
                     own series go with it).",
                    &[("pool", &handle), ("cause", cause.name())],
                    n,
                );
            }
            let (panic, panics) = pool.panic();
            m.gauge(
                "rserpool_proxy_pool_panic",
                "1 while the pool is in panic mode (fewer than panic-threshold % of its PEs \
                 healthy: requests spread over all of them).",
                &[("pool", &handle)],
                f64::from(u8::from(panic)),
            );
            m.counter(
                "rserpool_proxy_pool_panics",
                "Times the pool entered panic mode.",
                &[("pool", &handle)],
                panics,
            );
            let slow_start = pool.config().slow_start_ms;
            if slow_start > 0 {
                let now = std::time::Instant::now();
                let window = std::time::Duration::from_millis(slow_start);
                for b in backends.iter().take(MAX_PE_SERIES) {
                    m.gauge(
                        "rserpool_proxy_pe_slow_start_share",
                        "Share of its full load a PE takes under slow start (1: ramped up).",
                        &[("pool", &handle), ("pe", &format!("{:#010x}", b.id))],
                        b.ramp(now, window),
                    );
                }
            }
            for (class, n) in RESPONSE_CLASSES.iter().zip(pool.responses()) {
                m.counter(
                    "rserpool_proxy_responses",
                    "Responses to clients of requests routed to the pool, by status class (the \
                     PE's, or the proxy's own when no PE answered).",
                    &[("pool", &handle), ("code", class)],
                    n,
                );
            }
            m.counter(
                "rserpool_proxy_circuit_refused",
                "Requests the pool's circuit breaker (max-requests) refused with 503.",
                &[("pool", &handle)],
                pool.circuit_refused(),
            );
            m.counter(
                "rserpool_proxy_retries_refused",
                "Retries the pool's retry budget refused (the request got 503).",
                &[("pool", &handle)],
                pool.retries_refused(),
            );
        }
        if let Some(k) = self.kernel() {
            k.metrics(&mut m);
        }
        if let Some(t) = self
            .inner
            .tier
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            t.metrics(&mut m);
        }
        rserpool_status::metrics::process(&mut m);
        m
    }
}

/// One of a PE's counters.
type Field = fn(&Backend) -> &AtomicU64;

/// One PE's series (or the sum of several, for `pe="other"`).
fn pe_metrics(m: &mut Exposition, pool: &str, pe: &str, bs: &[&Backend]) {
    let labels = [("pool", pool), ("pe", pe)];
    let sum = |f: Field| -> u64 { bs.iter().map(|b| f(b).load(Ordering::Relaxed)).sum() };
    let counters: [(&str, &str, Field); 9] = [
        (
            "rserpool_proxy_requests",
            "Requests (HTTP) or connections (TCP) sent to the PE.",
            |b| &b.stats.requests,
        ),
        (
            "rserpool_proxy_pe_connections",
            "Connections opened to the PE.",
            |b| &b.stats.connections,
        ),
        (
            "rserpool_proxy_pe_failures",
            "Requests or connections the PE failed.",
            |b| &b.stats.failures,
        ),
        (
            "rserpool_proxy_failovers",
            "Requests or connections moved on from the PE after it failed them.",
            |b| &b.stats.failovers,
        ),
        (
            "rserpool_proxy_pe_ejections_capped",
            "Failures that would have ejected the PE had the pool's max-ejection-percent allowed it.",
            |b| &b.stats.ejections_capped,
        ),
        (
            "rserpool_proxy_pe_busy",
            "Times the PE was found busy (connect timeout, 503) and given no new work for a while.",
            |b| &b.stats.busy,
        ),
        (
            "rserpool_proxy_responses_5xx",
            "5xx responses from the PE.",
            |b| &b.stats.responses_5xx,
        ),
        (
            "rserpool_proxy_pe_sent_bytes",
            "Bytes relayed from clients to the PE: request bodies (HTTP; the heads the proxy \
             writes are not counted), or all of them (TCP).",
            |b| &b.stats.bytes_in,
        ),
        (
            "rserpool_proxy_pe_received_bytes",
            "Bytes relayed from the PE to clients.",
            |b| &b.stats.bytes_out,
        ),
    ];
    for (name, help, f) in counters {
        m.counter(name, help, &labels, sum(f));
    }
    for cause in EjectCause::ALL {
        let n = bs
            .iter()
            .map(|b| b.stats.ejections_by[cause.index()].load(Ordering::Relaxed))
            .sum();
        m.counter(
            "rserpool_proxy_ejections",
            "Times the PE was ejected by passive health and outlier detection, by cause: \
             failures (in a row), 5xx (in a row), success-rate.",
            &[("pool", pool), ("pe", pe), ("cause", cause.name())],
            n,
        );
    }
    m.gauge(
        "rserpool_proxy_pe_active",
        "Requests or connections under way at the PE.",
        &labels,
        sum(|b| &b.stats.active) as f64,
    );
    let credits: Vec<i64> = bs.iter().filter_map(|b| b.credits_left()).collect();
    if !credits.is_empty() {
        m.gauge(
            "rserpool_proxy_pe_credits",
            "Credits the PE has left (salbnet), where it reports them.",
            &labels,
            credits.iter().sum::<i64>() as f64,
        );
    }
    let mut latency: Option<HistogramSnapshot> = None;
    for b in bs {
        let h = b.stats.latency.snapshot();
        latency = Some(match latency {
            None => h,
            Some(mut acc) => {
                for (a, (_, n)) in acc.buckets.iter_mut().zip(h.buckets) {
                    a.1 += n;
                }
                acc.sum += h.sum;
                acc.count += h.count;
                acc
            }
        });
    }
    if let Some(h) = latency {
        m.histogram(
            "rserpool_proxy_pe_latency_seconds",
            "Time from sending a request to the PE's response head (HTTP), or to the \
             connection being established (TCP).",
            &labels,
            h,
        );
    }
}

/// A level's series; those of requests that ended only where they are counted (`finished`).
fn level_metrics(
    m: &mut Exposition,
    pool: &str,
    l: &crate::balance::admit::LevelStats,
    finished: bool,
) {
    let level = l.level.to_string();
    let labels = [("pool", pool), ("level", level.as_str())];
    let counters = [
        (
            "rserpool_proxy_level_admitted",
            "Requests of the service level given a PE, at once or after waiting.",
            l.admitted,
        ),
        (
            "rserpool_proxy_level_queued",
            "Requests of the service level that waited for a PE.",
            l.queued,
        ),
        (
            "rserpool_proxy_level_shed",
            "Requests of the service level refused (queue full, or pushed out by a higher level).",
            l.shed,
        ),
        (
            "rserpool_proxy_level_timed_out",
            "Requests of the service level refused after their queue timeout.",
            l.timed_out,
        ),
    ];
    for (name, help, v) in counters {
        m.counter(name, help, &labels, v);
    }
    if finished {
        m.counter(
            "rserpool_proxy_level_finished",
            "Requests of the service level finished at a PE (with [levels]).",
            &labels,
            l.finished,
        );
        m.counter_f64(
            "rserpool_proxy_level_service_seconds",
            "Time requests of the service level spent at PEs, in all (with [levels]).",
            &labels,
            l.service_us_total as f64 / 1e6,
        );
    }
    m.counter_f64(
        "rserpool_proxy_level_wait_seconds",
        "Time requests of the service level waited for a PE, in all.",
        &labels,
        l.wait_us_total as f64 / 1e6,
    );
    m.gauge(
        "rserpool_proxy_level_waiting",
        "Requests of the service level waiting for a PE now.",
        &labels,
        l.waiting as f64,
    );
    m.gauge(
        "rserpool_proxy_level_tickets",
        "The service level's tickets in its priority domain.",
        &labels,
        f64::from(l.tickets),
    );
}
