//! The dashboards in a real browser: Debian's headless `chromium`, driven over its DevTools
//! protocol (a WebSocket; `.ci/run` installs chromium). The registrar's page shows a PE that
//! registers, and drops one that is SIGKILLed, within 2 s, without a reload; the proxy's page
//! counts requests per PE and charts them; both fit a phone's width; screenshots are checked
//! for a real render and kept (`RSERPOOL_SCREENSHOTS=DIR` copies them there, as for the
//! README).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use base64::Engine as _;
use common::{BIN, KillOnDrop, example_http, fast_config, free_port, registrar, wait_for};
use serde_json::{Value, json};
use std::io::BufRead;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tungstenite::{Message, WebSocket, stream::MaybeTlsStream};

/// The within-2-s promise of the dashboard.
const LIVE: Duration = Duration::from_secs(2);

/// A headless chromium with one page attached over the DevTools protocol; the whole process
/// group goes when dropped.
struct Browser {
    child: Child,
    profile: PathBuf,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    session: String,
}

impl Browser {
    fn launch() -> Self {
        let profile = std::env::temp_dir().join(format!("rserpool-chromium-{}", free_port()));
        let mut child = Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1200,900",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("chromium (Debian's package; .ci/run installs it)");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("chromium announces its DevTools endpoint within 30 s");
        let (ws, _) = tungstenite::connect(url.as_str()).unwrap();
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        }
        let mut b = Self {
            child,
            profile,
            ws,
            next_id: 0,
            session: String::new(),
        };
        let target = b.call("Target.createTarget", json!({"url": "about:blank"}));
        let attached = b.call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        b.session = attached["sessionId"].as_str().unwrap().to_owned();
        b
    }

    /// A DevTools command (on the page once attached); its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let Message::Text(t) = self.ws.read().unwrap() else {
                continue;
            };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    /// The value of a script expression.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true}),
        );
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is true in the page; how long it took.
    fn wait(&mut self, limit: Duration, what: &str, expr: &str) -> Duration {
        let start = Instant::now();
        loop {
            if self.eval(expr) == json!(true) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < limit,
                "{what}: not within {limit:?}; the page says: {}",
                self.eval("document.body.innerText")
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// A screenshot, checked for a real render (not one flat colour), kept as `name`.
    fn screenshot(&mut self, name: &str) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(&png))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        let px = info.color_type.samples();
        let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(px).collect();
        assert!(info.width >= 300 && info.height >= 300, "{name}: {info:?}");
        let mut colours = std::collections::HashMap::<&[u8], usize>::new();
        for p in &pixels {
            *colours.entry(&p[..3]).or_default() += 1;
        }
        let background = colours.values().max().copied().unwrap_or(0);
        let drawn = 1.0 - background as f64 / pixels.len() as f64;
        assert!(
            colours.len() >= 16 && drawn > 0.05,
            "{name}: an empty render ({} colours, {:.1} % drawn)",
            colours.len(),
            drawn * 100.0
        );
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        std::fs::write(dir.join(name), &png).unwrap();
        if let Ok(dir) = std::env::var("RSERPOOL_SCREENSHOTS") {
            std::fs::write(PathBuf::from(dir).join(name), &png).unwrap();
        }
    }

    /// The page as a phone shows it (or back to the desktop).
    fn phone(&mut self, on: bool) {
        if on {
            self.call(
                "Emulation.setDeviceMetricsOverride",
                json!({"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": true}),
            );
        } else {
            self.call("Emulation.clearDeviceMetricsOverride", json!({}));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.ws.close(None);
        if let Some(pgid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

const ROWS: &str = "document.querySelectorAll('tr[data-pe]').length";

fn has_pe(id: u32) -> String {
    format!("document.querySelector('tr[data-pe=\"{id:#010x}\"]') !== null")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registrar_dashboard_follows_pes_live() {
    let reg = registrar(fast_config());
    let status = reg.status_addr().unwrap();
    let mut first = example_http(reg.asap_addr(), "WebPool", 1, &["--policy", "lu"]).await;
    let _other = example_http(reg.asap_addr(), "EchoPool", 9, &[]).await;
    wait_for(Duration::from_secs(10), "both registered", || async {
        common::registrar_status(status)
            .await
            .is_some_and(|s| s.pool_elements == 2)
    })
    .await;
    let url = format!("http://{status}/");
    let mut b = tokio::task::spawn_blocking(move || {
        let mut b = Browser::launch();
        b.navigate(&url);
        b.wait(Duration::from_secs(10), "the first PE shown", &has_pe(1));
        b
    })
    .await
    .unwrap();

    // A PE registers: the page shows it within 2 s of the registrar having it.
    let _second = example_http(reg.asap_addr(), "WebPool", 2, &["--policy", "lu"]).await;
    wait_for(Duration::from_secs(10), "PE 2 registered", || async {
        common::registrar_status(status)
            .await
            .is_some_and(|s| s.pools.iter().flat_map(|p| &p.pes).any(|pe| pe.id == 2))
    })
    .await;
    let (mut b, shown) = tokio::task::spawn_blocking(move || {
        let t = b.wait(LIVE, "the registered PE shown within 2 s", &has_pe(2));
        (b, t)
    })
    .await
    .unwrap();
    println!("a registered PE was shown after {shown:?}");
    let mut b = tokio::task::spawn_blocking(move || {
        assert_eq!(b.eval(ROWS), json!(3));
        assert_eq!(
            b.eval("document.getElementById('live').textContent"),
            json!("live")
        );
        b.screenshot("dashboard-registrar.png");
        b.phone(true);
        // On a phone the page keeps to the screen's width (wide tables scroll in their card).
        let fits = "document.documentElement.scrollWidth <= window.innerWidth + 1";
        b.wait(Duration::from_secs(5), "the page fits a phone", fits);
        b.screenshot("dashboard-registrar-phone.png");
        b.phone(false);
        b
    })
    .await
    .unwrap();

    // A PE is killed: the page drops it within 2 s, without a reload.
    b.eval("window.kept = true");
    common::signal(&first, rustix::process::Signal::KILL);
    let killed = Instant::now();
    let _ = first.wait();
    let (mut b, gone) = tokio::task::spawn_blocking(move || {
        b.wait(
            LIVE,
            "the killed PE dropped within 2 s",
            &format!("!({})", has_pe(1)),
        );
        (b, killed.elapsed())
    })
    .await
    .unwrap();
    println!("a killed PE was dropped after {gone:?}");
    assert_eq!(
        b.eval("window.kept === true"),
        json!(true),
        "the page reloaded"
    );
    assert_eq!(b.eval(ROWS), json!(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_dashboard_counts_and_charts_requests_per_pe() {
    let reg = registrar(fast_config());
    let _pes = [
        example_http(reg.asap_addr(), "WebPool", 1, &[]).await,
        example_http(reg.asap_addr(), "WebPool", 2, &[]).await,
    ];
    let front = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _proxy = KillOnDrop(
        Command::new(BIN)
            .args(["proxy", "--listen", &front.to_string(), "--pool", "WebPool"])
            .args(["--registrar", &reg.asap_addr().to_string()])
            .args(["--refresh-ms", "200", "--status", &status.to_string()])
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    wait_for(Duration::from_secs(10), "the proxy serves", || async {
        rserpool_proxy::http::client::Client::connect(front)
            .await
            .is_ok()
    })
    .await;
    let url = format!("http://{status}/");
    let mut b = tokio::task::spawn_blocking(move || {
        let mut b = Browser::launch();
        b.navigate(&url);
        b.wait(
            Duration::from_secs(10),
            "both PEs shown",
            &format!("{ROWS} === 2"),
        );
        b
    })
    .await
    .unwrap();
    // Traffic for a few seconds, so that the chart has points.
    let load = tokio::spawn(async move {
        let mut c = rserpool_proxy::http::client::Client::connect(front)
            .await
            .unwrap();
        for _ in 0..60 {
            assert_eq!(c.get("/").await.unwrap().code, 200);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    });
    let requests = "[...document.querySelectorAll('tr[data-pe]')]\
        .map(r => +r.cells[3].textContent.replace(/,/g, '')).reduce((a, b) => a + b, 0)";
    let mut b = tokio::task::spawn_blocking(move || {
        b.wait(
            Duration::from_secs(10),
            "requests counted and charted",
            &format!(
                "{requests} >= 30 && [...document.querySelectorAll('svg.spark polyline')]\
                 .some(l => l.getAttribute('points').split(' ').length >= 3)"
            ),
        );
        b
    })
    .await
    .unwrap();
    load.await.unwrap();
    b = tokio::task::spawn_blocking(move || {
        b.wait(
            Duration::from_secs(5),
            "all 60 requests counted, the PEs in use, the pool's resilience shown",
            &format!(
                "{requests} === 60 && [...document.querySelectorAll('tr[data-pe]')]\
                 .every(r => r.cells[2].textContent === 'in use') \
                 && document.body.textContent.includes('panic mode') \
                 && document.body.textContent.includes('retries refused')"
            ),
        );
        b.screenshot("dashboard-proxy.png");
        b
    })
    .await
    .unwrap();
    drop(b);
}
