//! What the integration tests share: the binary under test, free ports, child processes that
//! cannot outlive a test (and their logs), a registrar with short timers and its status, and
//! waiting for a condition.

// Each test file uses its own subset.
#![allow(dead_code)]

pub mod bridge;

use rserpool_registrar::{Config, RegistrarThread, Status, StatusListen};
use std::future::Future;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_rserpool");

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    rserpool::util::free_port().unwrap()
}

/// A child process, killed and reaped when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// An `rserpool` process whose log (stderr) is collected while it runs. With `TEST_LOG` set in
/// the environment, its lines are also printed, prefixed with `name`.
pub struct Logged {
    pub proc: KillOnDrop,
    log: Arc<Mutex<Vec<String>>>,
}

impl Logged {
    /// Runs `rserpool ARGS` with `RUST_LOG=filter`.
    pub fn spawn(name: &str, args: &[String], filter: &str) -> Self {
        Self::spawn_exe(std::path::Path::new(BIN), name, args, filter)
    }

    /// [`spawn`](Self::spawn) with the binary at `exe` (a copy, as an upgrade installs).
    pub fn spawn_exe(exe: &std::path::Path, name: &str, args: &[String], filter: &str) -> Self {
        let mut cmd = Command::new(exe);
        cmd.env("NO_COLOR", "1");
        Self::spawn_cmd(cmd, name, args, filter)
    }

    /// [`spawn`](Self::spawn) with the environment as a deployment has it (no `NO_COLOR`): the
    /// log goes to a pipe, not a terminal.
    pub fn spawn_as_deployed(name: &str, args: &[String], filter: &str) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.env_remove("NO_COLOR");
        Self::spawn_cmd(cmd, name, args, filter)
    }

    pub fn spawn_cmd(mut cmd: Command, name: &str, args: &[String], filter: &str) -> Self {
        let mut child = cmd
            .args(args)
            .env("RUST_LOG", filter)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rserpool");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = log.clone();
        let echo = std::env::var_os("TEST_LOG")
            .is_some()
            .then(|| name.to_string());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(name) = &echo {
                    eprintln!("[{name}] {line}");
                }
                lines.lock().unwrap().push(line);
            }
        });
        Self {
            proc: KillOnDrop(child),
            log,
        }
    }

    /// The log lines so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        let log = self.log.lock().unwrap();
        log.iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    /// The `0x`-prefixed hexadecimal number right after `marker` in the first log line that
    /// also contains `context`, once there is one.
    /// On a timeout the panic shows the process's log so far (why it did not start, say).
    pub async fn hex_after(&self, marker: &str, context: &str, limit: Duration) -> u32 {
        let start = Instant::now();
        loop {
            let found = self.lines_with(context).iter().find_map(|l| {
                let hex = l[l.find(marker)? + marker.len()..].strip_prefix("0x")?;
                let end = hex
                    .find(|c: char| !c.is_ascii_hexdigit())
                    .unwrap_or(hex.len());
                u32::from_str_radix(&hex[..end], 16).ok()
            });
            if let Some(v) = found {
                return v;
            }
            if start.elapsed() >= limit {
                let log = self.log.lock().unwrap().join("\n");
                panic!("timed out after {limit:?} waiting for \"{marker}\" in the log:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `rserpool ARGS`, logging warnings and worse to nowhere; killed when dropped.
pub fn spawn(args: &[&str]) -> KillOnDrop {
    KillOnDrop(
        Command::new(BIN)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rserpool"),
    )
}

/// `rserpool ARGS` in network namespace `ns`, logging at the level in the environment
/// variable `log_var` (default warn) to the test's stderr.
pub fn spawn_in<S: AsRef<std::ffi::OsStr>>(ns: &str, args: &[S], log_var: &str) -> KillOnDrop {
    KillOnDrop(
        Command::new("ip")
            .args(["netns", "exec", ns, BIN])
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var(log_var).unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn rserpool in a namespace"),
    )
}

/// Sends `sig` to `child`.
pub fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_child(child);
    rustix::process::kill_process(pid, sig).unwrap();
}

/// A registrar configuration on free loopback ports with short keep-alive timers.
pub fn fast_config() -> Config {
    Config {
        keep_alive_interval_ms: 300,
        keep_alive_timeout_ms: 300,
        ..local_config()
    }
}

/// A registrar configuration on free loopback ports with the default timers: for tests that
/// lose no PE, where a PE's keep-alive answer held up for 300 ms on a loaded machine would
/// take it out of its pool in the middle of the test.
pub fn local_config() -> Config {
    Config {
        asap: "127.0.0.1:0".parse().unwrap(),
        enrp: "127.0.0.1:0".parse().unwrap(),
        status: StatusListen::given(Some("127.0.0.1:0".parse().unwrap())),
        ..Config::default()
    }
}

/// A registrar in a thread of the test process.
pub fn registrar(cfg: Config) -> RegistrarThread {
    RegistrarThread::start(cfg).expect("registrar starts")
}

/// A registrar's status from its status listener, or `None` if it does not answer.
pub async fn registrar_status(status: SocketAddr) -> Option<Status> {
    rserpool::util::registrar_status(&[status]).await.ok()
}

/// What a polled condition answers: `bool`, or `Result<(), String>` to say why not yet.
pub trait Outcome {
    /// `None` when the condition holds, else why not (may be empty).
    fn pending(self) -> Option<String>;
}

impl Outcome for bool {
    fn pending(self) -> Option<String> {
        (!self).then(String::new)
    }
}

impl Outcome for Result<(), String> {
    fn pending(self) -> Option<String> {
        self.err()
    }
}

/// Polls the asynchronous `cond` every 20 ms until it holds; panics naming `what` after
/// `limit`. Returns the time it took.
pub async fn wait_for<F, Fut>(limit: Duration, what: &str, mut cond: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Outcome,
{
    let start = Instant::now();
    loop {
        let Some(why) = cond().await.pending() else {
            return start.elapsed();
        };
        let why = if why.is_empty() {
            why
        } else {
            format!(": {why}")
        };
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}{why}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`wait_for`] with a condition that needs no waiting to evaluate.
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    wait_for(limit, what, || std::future::ready(cond())).await
}

/// A PE identifier as the proxy's `X-Pe-Id` shows it.
/// The Content-Length of a response head (0 without one).
pub fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

pub fn id(n: u32) -> String {
    format!("{n:#010x}")
}

/// Serves HTTP requests on `s` as PE `pe`: each is answered with its PE ID after `delay`,
/// counted in `in_flight` meanwhile.
pub async fn answer_after(
    mut s: tokio::net::TcpStream,
    pe: u32,
    delay: Duration,
    in_flight: Option<rserpool_asap::InFlight>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        buf.drain(..end);
        let _work = in_flight.as_ref().map(|f| f.enter());
        tokio::time::sleep(delay).await;
        let body = format!("PE {}\n", id(pe));
        let head = format!(
            "HTTP/1.1 200 OK\r\nX-Pe-Id: {}\r\nContent-Length: {}\r\n\r\n",
            id(pe),
            body.len()
        );
        if s.write_all(format!("{head}{body}").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Which PE (its `X-Pe-Id`) answered each of `n` GETs through `front`, one after the other.
pub async fn answers(front: SocketAddr, n: usize) -> Vec<String> {
    let mut c = rserpool_proxy::http::client::Client::connect(front)
        .await
        .unwrap();
    let mut v = Vec::new();
    for _ in 0..n {
        let r = c.get("/").await.unwrap();
        assert_eq!(r.code, 200);
        v.push(r.header("x-pe-id").unwrap());
    }
    v
}

/// `rserpool example http` as PE `pe` of `pool`, registered at `reg`, with `extra` flags
/// (its policy and so on); returns once it listens.
pub async fn example_http(reg: SocketAddr, pool: &str, pe: u32, extra: &[&str]) -> KillOnDrop {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let child = Command::new(BIN)
        .args(["example", "http", "--pool", pool, "--id", &pe.to_string()])
        .args([
            "--listen",
            &addr.to_string(),
            "--registrar",
            &reg.to_string(),
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(10), "example listening", || {
        std::net::TcpStream::connect(addr).is_ok()
    })
    .await;
    KillOnDrop(child)
}

/// One sample of a scrape: its name (with `_total`, `_bucket`, …), labels and value.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct MetricSample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// `GET /metrics` from a status listener, checked by the reference OpenMetrics parser (the
/// Python `prometheus_client`'s, strict: it refuses what Prometheus would refuse) and returned
/// as samples. Asked as Prometheus asks (OpenMetrics preferred), the answer must be OpenMetrics.
pub async fn scrape(status: SocketAddr) -> Vec<MetricSample> {
    const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0;q=0.5,\
        application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
    let (code, content_type, body) =
        rserpool_status::get_accepting(status, "/metrics", Some(PROMETHEUS_ACCEPT))
            .await
            .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    const CHECK: &str = "
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for f in text_string_to_metric_families(sys.stdin.read()):
    for s in f.samples:
        out.append({'name': s.name, 'labels': s.labels, 'value': float(s.value)})
print(json.dumps(out))
";
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", CHECK])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 with python3-prometheus-client (.ci/run installs it)");
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(&body).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the metrics of {status} are not valid OpenMetrics: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&body)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `GET /metrics` from a status listener as a scraper that does not ask for OpenMetrics (no
/// `Accept`, or the text format's), checked by `promtool check metrics` (Prometheus's own
/// parser and linter; .ci/run installs it): text format 0.0.4, no problem reported.
pub async fn promtool_check(status: SocketAddr) {
    for accept in [None, Some("text/plain;version=0.0.4")] {
        let (code, content_type, body) = rserpool_status::get_accepting(status, "/metrics", accept)
            .await
            .unwrap();
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
        let mut child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("promtool (Debian's prometheus package; .ci/run installs it)");
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(&body).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics of {status} ({accept:?}): {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&body)
        );
    }
}

/// The sum of the samples named `name` whose labels include `labels`.
pub fn metric(samples: &[MetricSample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// Whether Debian's `haproxy` is here for a side-by-side test; in CI (`.ci/run` installs it)
/// its absence fails the test, elsewhere the test is skipped with a note.
pub fn haproxy_here() -> bool {
    Command::new("haproxy").arg("-v").output().is_ok()
        || !rserpool_ksplice::testbed::skip("haproxy is missing (.ci/run installs it)")
}

/// The Grafana dashboard `file` of `dist/grafana`.
fn dashboard(file: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../dist/grafana")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every PromQL expression of the Grafana dashboard `file` (its panels' targets and its
/// variables' queries).
pub fn dashboard_exprs(file: &str) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(e)) => {
                            out.push(e.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dashboard(file), &mut out);
    out
}

/// The metric names (as samples name them: `_total`, `_bucket`) that the expressions of the
/// Grafana dashboard `file` use.
pub fn dashboard_metrics(file: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for e in dashboard_exprs(file) {
        let words = e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'));
        names.extend(
            words
                .filter(|w| w.starts_with("rserpool_") || w.starts_with("process_"))
                .map(str::to_owned),
        );
    }
    names
}

/// The sample names in a scrape's text.
pub fn sample_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// Fails unless every metric the Grafana dashboard `file` uses is among `live` (the sample
/// names of running processes), and Prometheus's own parser (`promtool check rules`) takes
/// every expression of it.
pub fn check_dashboard(file: &str, live: &std::collections::BTreeSet<String>) {
    let used = dashboard_metrics(file);
    assert!(used.len() >= 5, "{file} uses hardly any metric: {used:?}");
    let missing: Vec<&String> = used.difference(live).collect();
    assert!(
        missing.is_empty(),
        "{file} uses metrics that no running process has: {missing:?}"
    );
    // As recording rules, with Grafana's variables given values.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in dashboard_exprs(file).iter().enumerate() {
        if e.starts_with("label_values(") {
            continue;
        }
        let e = e
            .replace("$__rate_interval", "1m")
            .replace("$instance", ".*");
        let quoted = serde_json::to_string(&e).unwrap();
        rules.push_str(&format!(
            "      - record: dashboard:expr_{i}\n        expr: {quoted}\n"
        ));
    }
    let path =
        std::env::temp_dir().join(format!("rserpool-{}-{file}.rules.yml", std::process::id()));
    std::fs::write(&path, rules).unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .expect("promtool (Debian's prometheus package; .ci/run installs it)");
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "promtool check rules on the expressions of {file}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Python of the Debian packages the fixtures use (grpcio, h2, websockets).
pub const PYTHON: &str = "/usr/bin/python3";

/// `tests/fixtures/grpc_echo.py`: a gRPC server of `test.Echo` that answers `NAME:request`.
pub const GRPC_ECHO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/grpc_echo.py");

/// A gRPC echo server named `name` on a port of its own choosing, and that port.
pub async fn grpc_server(name: &str) -> (KillOnDrop, u16) {
    // The server takes a free port itself and says which: a port picked here could be taken
    // by a process of a test running beside this one before the server binds it.
    let mut child = Command::new(PYTHON)
        .args([GRPC_ECHO, "serve", "0", name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let server = KillOnDrop(child);
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map(|_| line)
    });
    let line = tokio::time::timeout(Duration::from_secs(15), line)
        .await
        .expect("the gRPC server listens within 15 s")
        .unwrap()
        .unwrap();
    let port: u16 = line
        .trim()
        .strip_prefix("listening ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("the gRPC server says {line:?}"));
    (server, port)
}

/// A target for sidecar tests: it keeps the connections that come from the ports of
/// [`HoldingTarget::connect`] (the work) and closes the others (the sidecar's health checks)
/// at once.
pub struct HoldingTarget {
    pub listener: std::net::TcpListener,
    pub addr: SocketAddr,
    ours: Arc<Mutex<Vec<u16>>>,
    pub held: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl HoldingTarget {
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let ours = Arc::new(Mutex::new(Vec::<u16>::new()));
        let held = Arc::new(Mutex::new(Vec::<std::net::TcpStream>::new()));
        let (keep, ports) = (held.clone(), ours.clone());
        let accepting = listener.try_clone().unwrap();
        std::thread::spawn(move || {
            for s in accepting.incoming() {
                let Ok(s) = s else { break };
                let from = s.peer_addr().map(|a| a.port()).unwrap_or(0);
                if ports.lock().unwrap().contains(&from) {
                    keep.lock().unwrap().push(s);
                }
            }
        });
        Self {
            listener,
            addr,
            ours,
            held,
        }
    }

    /// A connection the target holds.
    pub fn connect(&self) -> std::net::TcpStream {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let port = s.local_addr().unwrap().as_socket().unwrap().port();
        self.ours.lock().unwrap().push(port);
        s.connect(&self.addr.into()).unwrap();
        std::net::TcpStream::from(s)
    }
}
