//! The operator's surface over real sockets: `/metrics` of a registrar, a proxy and a `serve`
//! sidecar (valid OpenMetrics, counting what happened, and text that promtool passes), the
//! dashboard page and its event stream on both the registrar's mio loop and the proxy's tokio
//! listener.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    BIN, example_http, fast_config, free_port, metric, promtool_check, registrar, scrape, spawn,
    wait_for,
};
use rserpool_proxy::http::client::Client;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn local() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_openmetrics_and_prometheus_text_and_count_what_happened() {
    let reg = registrar(fast_config());
    let reg_status = reg.status_addr().unwrap();
    let r = reg.asap_addr().to_string();
    let _pes = [
        example_http(reg.asap_addr(), "Web", 1, &[]).await,
        example_http(reg.asap_addr(), "Web", 2, &[]).await,
    ];
    let (front, proxy_status) = (local(), local());
    let _proxy = spawn(&[
        "proxy",
        "--listen",
        &front.to_string(),
        "--pool",
        "Web",
        "--registrar",
        &r,
        "--refresh-ms",
        "200",
        "--status",
        &proxy_status.to_string(),
    ]);
    // A sidecar for a plain TCP service, with its own status listener.
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target_addr = target.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((s, _)) = target.accept().await {
            drop(s);
        }
    });
    let serve_status = local();
    let _serve = spawn(&[
        "serve",
        "--target",
        &target_addr,
        "--pool",
        "Side",
        "--registrar",
        &r,
        "--check-interval-ms",
        "100",
        "--status",
        &serve_status.to_string(),
    ]);

    wait_for(
        Duration::from_secs(10),
        "the proxy sees both PEs",
        || async {
            rserpool_status::get(proxy_status, "/status")
                .await
                .ok()
                .and_then(|(_, b)| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|d| d["pools"][0]["pool_elements"].as_array().map(Vec::len))
                == Some(2)
        },
    )
    .await;
    ten_requests_and_an_unknown_pool(front, &r).await;

    let m = scrape(proxy_status).await;
    assert_eq!(
        metric(&m, "rserpool_proxy_requests_total", &[("pool", "Web")]),
        10.0
    );
    assert_eq!(
        metric(
            &m,
            "rserpool_proxy_responses_total",
            &[("pool", "Web"), ("code", "2xx")]
        ),
        10.0
    );
    assert_eq!(
        metric(&m, "rserpool_proxy_responses_total", &[("pool", "Web")]),
        10.0
    );
    let counted = metric(
        &m,
        "rserpool_proxy_pe_latency_seconds_count",
        &[("pool", "Web")],
    );
    assert_eq!(counted, 10.0, "one latency per request");
    let le_inf = metric(
        &m,
        "rserpool_proxy_pe_latency_seconds_bucket",
        &[("pool", "Web"), ("le", "+Inf")],
    );
    assert_eq!(le_inf, 10.0);
    assert_eq!(
        metric(&m, "rserpool_proxy_pool_elements", &[("pool", "Web")]),
        2.0
    );
    assert_eq!(metric(&m, "rserpool_proxy_registrar_reachable", &[]), 1.0);
    assert!(metric(&m, "process_resident_memory_bytes", &[]) > 1e6);
    let pes: std::collections::BTreeSet<_> = m
        .iter()
        .filter(|s| s.name == "rserpool_proxy_requests_total")
        .filter_map(|s| s.labels.get("pe").cloned())
        .collect();
    assert_eq!(pes.len(), 2, "a series per PE: {pes:?}");

    wait_for(Duration::from_secs(10), "the sidecar registers", || async {
        metric(
            &scrape(serve_status).await,
            "rserpool_serve_registered",
            &[],
        ) == 1.0
    })
    .await;
    let s = scrape(serve_status).await;
    assert_eq!(
        metric(&s, "rserpool_serve_target_up", &[("pool", "Side")]),
        1.0
    );
    assert!(metric(&s, "rserpool_serve_health_checks_total", &[]) >= 1.0);
    assert_eq!(
        metric(&s, "rserpool_serve_health_check_failures_total", &[]),
        0.0
    );
    let (code, body) = rserpool_status::get(serve_status, "/status").await.unwrap();
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["registered"], true, "{doc}");

    let g = scrape(reg_status).await;
    assert_eq!(metric(&g, "rserpool_registrar_pools", &[]), 2.0);
    assert_eq!(
        metric(&g, "rserpool_registrar_pool_elements", &[("pool", "Web")]),
        2.0
    );
    assert_eq!(
        metric(&g, "rserpool_registrar_pool_elements", &[("pool", "Side")]),
        1.0
    );
    assert_eq!(
        metric(&g, "rserpool_registrar_home_pool_elements", &[]),
        3.0
    );
    assert!(metric(&g, "rserpool_registrar_registrations_total", &[]) >= 3.0);
    assert!(metric(&g, "rserpool_registrar_resolutions_total", &[]) >= 1.0);
    assert_eq!(
        metric(
            &g,
            "rserpool_registrar_errors_sent_total",
            &[("cause", "0x9")]
        ),
        1.0,
        "{g:?}"
    );
    let id = format!("{:#010x}", reg.server_id());
    assert_eq!(
        metric(&g, "rserpool_registrar_info", &[("server_id", &id)]),
        1.0
    );
    assert!(metric(&g, "process_cpu_seconds_total", &[]) >= 0.0);
    assert!(g.iter().any(|s| s.name == "process_cpu_seconds_total"));

    // A scraper that does not ask for OpenMetrics (promtool, many others) gets the text
    // format, which promtool finds nothing wrong with.
    for status in [reg_status, proxy_status, serve_status] {
        promtool_check(status).await;
    }
}

/// The Grafana dashboards of `dist/grafana` use only metrics that running processes have: a
/// cluster of two registrars (the ENRP series), PEs that report credits, a proxy that served
/// requests through service levels. Prometheus's parser takes every expression. (The kernel
/// splice and tier dashboard is checked in `tests/tier.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grafana_dashboards_use_only_metrics_that_exist() {
    let r1 = registrar(fast_config());
    let r2 = registrar(rserpool_registrar::Config {
        peer: vec![r1.enrp_addr().unwrap().into()],
        ..fast_config()
    });
    let r = r1.asap_addr().to_string();
    let _pes = [
        example_http(r1.asap_addr(), "Web", 1, &["--policy", "credits"]).await,
        example_http(r1.asap_addr(), "Web", 2, &["--policy", "credits"]).await,
    ];
    let (front, proxy_status) = (local(), local());
    let config = std::env::temp_dir().join(format!("rserpool-ops-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "registrars = [\"{r}\"]\nrefresh-ms = 200\nstatus = \"{proxy_status}\"\n\
             [levels]\ncount = 2\n\
             [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"Web\"\n"
        ),
    )
    .unwrap();
    let _proxy = spawn(&["proxy", "--config", config.to_str().unwrap()]);
    let _cleanup = Cleanup(config.clone());
    let peered = || async {
        let names = common::sample_names(&text_metrics(r2.status_addr().unwrap()).await);
        names.contains("rserpool_enrp_peer_connected")
    };
    wait_for(Duration::from_secs(10), "the registrars peer", peered).await;
    wait_for(Duration::from_secs(10), "the proxy has credits", || async {
        let names = common::sample_names(&text_metrics(proxy_status).await);
        names.contains("rserpool_proxy_pe_credits")
    })
    .await;
    ten_requests_and_an_unknown_pool(front, &r).await;
    let mut registrars = common::sample_names(&text_metrics(r1.status_addr().unwrap()).await);
    registrars.extend(common::sample_names(
        &text_metrics(r2.status_addr().unwrap()).await,
    ));
    common::check_dashboard("rserpool-registrars.json", &registrars);
    let proxy = common::sample_names(&text_metrics(proxy_status).await);
    common::check_dashboard("rserpool-proxy.json", &proxy);
}

/// Ten GETs through the proxy at `front`, all answered 200; then a resolution of a pool nobody
/// registered at registrar `r`, answered with Unknown Pool Handle (0x9), so that the
/// registrar's error series exist.
async fn ten_requests_and_an_unknown_pool(front: SocketAddr, r: &str) {
    let mut c = Client::connect(front).await.unwrap();
    for _ in 0..10 {
        assert_eq!(c.get("/").await.unwrap().code, 200);
    }
    let out = Command::new(BIN)
        .args(["resolve", "Nowhere", "--registrar", r])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// Removes a file when dropped.
struct Cleanup(std::path::PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A scrape in the text format (empty while nothing answers).
async fn text_metrics(status: SocketAddr) -> String {
    match rserpool_status::get(status, "/metrics").await {
        Ok((200, body)) => String::from_utf8(body).unwrap(),
        _ => String::new(),
    }
}

/// Reads an event stream's head and then `n` events; returns the events' data and when each
/// arrived.
async fn events(status: SocketAddr, n: usize) -> Vec<(Instant, serde_json::Value)> {
    let mut s = tokio::net::TcpStream::connect(status).await.unwrap();
    s.write_all(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        .await
        .unwrap();
    let mut lines = BufReader::new(s).lines();
    let read = async {
        let head = lines.next_line().await.unwrap().unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut saw_type = false;
        while let Some(l) = lines.next_line().await.unwrap() {
            saw_type |= l.eq_ignore_ascii_case("content-type: text/event-stream");
            if l.is_empty() {
                break;
            }
        }
        assert!(saw_type, "no event-stream content type");
        let mut out = Vec::new();
        let mut data = String::new();
        while out.len() < n {
            let l = lines.next_line().await.unwrap().unwrap();
            if let Some(d) = l.strip_prefix("data: ") {
                data.push_str(d);
                data.push('\n');
            } else if l.is_empty() && !data.is_empty() {
                out.push((Instant::now(), serde_json::from_str(&data).unwrap()));
                data.clear();
            }
        }
        out
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("three events within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_its_event_stream_on_the_registrar_and_the_proxy() {
    let reg = registrar(fast_config());
    let reg_status = reg.status_addr().unwrap();
    let _pe = example_http(reg.asap_addr(), "Web", 7, &[]).await;
    let proxy_status = local();
    let _proxy = spawn(&[
        "proxy",
        "--listen",
        &local().to_string(),
        "--pool",
        "Web",
        "--registrar",
        &reg.asap_addr().to_string(),
        "--status",
        &proxy_status.to_string(),
    ]);
    wait_for(Duration::from_secs(10), "the proxy's status", || async {
        rserpool_status::get(proxy_status, "/status").await.is_ok()
    })
    .await;
    for status in [reg_status, proxy_status] {
        let (code, page) = rserpool_status::get(status, "/").await.unwrap();
        assert_eq!(code, 200);
        let page = String::from_utf8(page).unwrap();
        assert!(page.starts_with("<!doctype html>"), "{status}");
        assert!(page.contains("new EventSource(\"events\")"));
        // Works offline: nothing is loaded from elsewhere.
        assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    }
    // Both streams at once on the registrar, with a status request served between events.
    let (a, b) = tokio::join!(events(reg_status, 3), events(reg_status, 2));
    assert_eq!(a[0].1["server_id"], reg.server_id(), "{}", a[0].1);
    assert_eq!(b[0].1["pool_elements"], 1);
    let gap = a[2].0 - a[1].0;
    assert!(
        gap >= Duration::from_millis(300) && gap <= Duration::from_millis(1500),
        "events every 500 ms, got {gap:?}"
    );
    assert_eq!(
        rserpool_status::get(reg_status, "/status").await.unwrap().0,
        200
    );
    let p = events(proxy_status, 2).await;
    assert!(p[1].1["listeners"].is_array(), "{}", p[1].1);
    // A client that goes away mid-stream costs nothing: the listener serves on.
    let mut s = tokio::net::TcpStream::connect(reg_status).await.unwrap();
    s.write_all(b"GET /events HTTP/1.1\r\n\r\n").await.unwrap();
    drop(s);
    assert_eq!(
        rserpool_status::get(reg_status, "/metrics")
            .await
            .unwrap()
            .0,
        200
    );
}
