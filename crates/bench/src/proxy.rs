//! `rserpool-bench proxy`: the rserpool proxy side by side with HAProxy and nginx, and with
//! the client talking to the backends directly (the physical baseline), in one run on one
//! machine — the comparison users make before switching (issue 5).
//!
//! The same three nginx backends serve every system: a small static file, large files, and
//! WebDAV PUT into tmpfs. Each backend is a pool element through an `rserpool serve` sidecar.
//! The same load generators drive every system with the same threads: `wrk` for requests/s
//! and connections/s, and rserpool's own HTTP client (`rserpool_proxy::client`) for TCP bulk
//! throughput, the seed paper's 100 concurrent uploads and downloads, and the failover run.
//!
//! Failover is measured from outside every proxy: a raw socket with a BPF filter timestamps
//! each connection attempt (SYN) to the killed backend, so "traffic off the dead PE" means no
//! proxy connects to it any more, whatever the proxy's own counters say. The sidecar checks
//! the backend on a second address so that its checks are not counted.

use crate::net::{free_port, local, registrar_status};
use crate::plot;
use crate::process::{Proc, wait_for};
use crate::procfs::{group_cpu_ns, machine_busy_since, machine_cpu_ticks};
use crate::report::{command_line, machine, today, write_section};
use crate::undo::{self, TempDir};
use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use rserpool_proxy::client::Client;
use serde::Serialize;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const POOL: &str = "BenchPool";
const BACKENDS: usize = 3;
const SMALL: &str = "/small.html";
const SMALL_SIZE: usize = 612; // nginx's welcome page
const BULK: &str = "/bulk";
const BULK_SIZE: usize = 256 << 20;
const MB: usize = 1 << 20;
const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";
const INSTALL: &str = "apt-get install -y wrk haproxy nginx libnginx-mod-stream iproute2";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum System {
    Direct,
    Rserpool,
    Haproxy,
    Nginx,
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::Direct => "direct",
            System::Rserpool => "rserpool",
            System::Haproxy => "HAProxy",
            System::Nginx => "nginx",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// HTTP/1.1 keep-alive, small response (wrk): requests/s, p50, p99.
    Keepalive,
    /// A new connection per request (wrk, Connection: close): connections/s.
    Connect,
    /// TCP mode bulk download: MB/s.
    Bulk,
    /// The seed's experiment: concurrent uploads (PUT) and downloads (GET) of large files.
    Transfer,
    /// A backend killed with SIGKILL under load.
    Failover,
}

#[derive(Args, Debug)]
pub struct ProxyBenchArgs {
    /// Worker threads of every proxy (rserpool --threads, HAProxy nbthread, nginx
    /// worker_processes) and of the load generators.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Concurrent connections of wrk.
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Length of each wrk run and of the bulk run, seconds.
    #[arg(long, default_value_t = 5)]
    pub duration_s: u64,
    /// Rounds; the systems alternate within a round and the report gives medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Concurrent transfers of the seed's experiment.
    #[arg(long, default_value_t = 100)]
    pub transfers: usize,
    /// Transfer sizes in MiB (repeatable); default 10 and 20.
    #[arg(long = "transfer-mb")]
    pub transfer_mb: Vec<usize>,
    /// Concurrent connections of the TCP bulk run.
    #[arg(long, default_value_t = 4)]
    pub bulk_connections: usize,
    /// Also run TCP bulk with every hop limited to this rate (Mbit/s, by `tc` on loopback, as
    /// on the seed paper's testbed network); 0 skips it.
    #[arg(long, default_value_t = 1000)]
    pub link_mbit: u64,
    /// Keep-alive clients of the failover run.
    #[arg(long, default_value_t = 8)]
    pub failover_clients: usize,
    /// How long the failover run watches after the kill, ms (HAProxy's default checks need
    /// about 6 s to take a server out).
    #[arg(long, default_value_t = 8000)]
    pub failover_ms: u64,
    /// Systems to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "direct,rserpool,haproxy,nginx"
    )]
    pub systems: Vec<System>,
    /// Parts to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "keepalive,connect,bulk,transfer,failover"
    )]
    pub parts: Vec<Part>,
    /// One JSON object per system and round on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the results as a Markdown section into this file (e.g. docs/BENCHMARKS.md).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write PNG bar charts with this path prefix (e.g. docs/bench-proxy).
    #[arg(long, value_name = "PREFIX")]
    pub plot: Option<String>,
}

#[derive(Serialize, Clone, Copy, Debug, Default)]
struct Wrk {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// CPU time of the proxy (all its processes and threads) per request, µs.
    cpu_us: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
struct Transfer {
    method: &'static str,
    mib: usize,
    avg_s: f64,
    total_s: f64,
    failed: usize,
}

#[derive(Serialize, Clone, Debug, Default)]
struct Failover {
    requests: u64,
    failed: u64,
    /// Kill → first connection attempt that was refused.
    visible_ms: Option<f64>,
    /// First refused attempt → last attempt of that burst (the next one came ≥ 500 ms later).
    off_ms: Option<f64>,
    burst_connects: usize,
    /// Attempts after the burst: re-probes, health checks, retries after a back-off.
    later_connects: usize,
    /// When they came, ms after the kill.
    later_at_ms: Vec<f64>,
}

#[derive(Serialize, Clone, Debug)]
struct Sample {
    system: System,
    round: usize,
    keepalive: Option<Wrk>,
    connect: Option<Wrk>,
    bulk_mib_s: Option<f64>,
    /// The share of the machine's CPU (all cores) that was busy during the loopback bulk run.
    bulk_busy: Option<f64>,
    /// The same over rate-limited hops (`--link-mbit`).
    bulk_link_mib_s: Option<f64>,
    transfers: Vec<Transfer>,
    failover: Option<Failover>,
}

pub fn run(args: ProxyBenchArgs, rserpool: &Path) -> Result<()> {
    if args.threads == 0 || args.connections == 0 || args.repeat == 0 || args.duration_s == 0 {
        bail!("--threads, --connections, --repeat and --duration-s must be at least 1");
    }
    check_tools(&args)?;
    undo::on_signal()?;
    let sizes = if args.transfer_mb.is_empty() {
        vec![10, 20]
    } else {
        args.transfer_mb.clone()
    };
    let versions = versions();
    if !args.json {
        println!("machine: {}", machine());
        println!("{versions}");
    }
    let mut bed = Bed::start(&sizes, rserpool)?;
    let mut samples = Vec::new();
    // Parts outside, systems inside: the systems meet one part back to back, under the same
    // conditions (large transfers leave the machine slower for a while).
    for round in 0..args.repeat {
        let mut round_samples: Vec<Sample> = args
            .systems
            .iter()
            .map(|&system| Sample::new(system, round))
            .collect();
        for &part in &args.parts {
            for rs in round_samples.iter_mut() {
                let mut s = Sample::new(rs.system, round);
                measure(&mut bed, &mut s, part, &sizes, &args)
                    .with_context(|| format!("measuring {}", rs.system.label()))?;
                if !args.json {
                    print_sample(&s);
                }
                rs.merge(s);
            }
        }
        for s in round_samples {
            if args.json {
                println!("{}", serde_json::to_string(&s)?);
            }
            samples.push(s);
        }
    }
    let report = Report::new(&args, &samples, &sizes);
    if let Some(path) = &args.markdown {
        write_section(path, "proxy", &report.markdown(&args, &versions))?;
    }
    if let Some(prefix) = &args.plot {
        report.plot(prefix)?;
    }
    Ok(())
}

/// Everything a run will need, checked before minutes of measuring.
fn check_tools(args: &ProxyBenchArgs) -> Result<()> {
    let mut tools = vec!["wrk", "haproxy", "nginx"];
    if args.parts.contains(&Part::Bulk) && args.link_mbit > 0 {
        tools.push("tc");
    }
    for tool in tools {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        if !found {
            bail!("`{tool}` is not installed; the proxy benchmark needs: {INSTALL}");
        }
    }
    if !Path::new(STREAM_MODULE).is_file() {
        bail!("nginx's stream module is missing ({STREAM_MODULE}); install: {INSTALL}");
    }
    if args.parts.contains(&Part::Failover) {
        raw_socket()?;
    }
    Ok(())
}

fn versions() -> String {
    let first_line = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .ok()
            .map(|o| {
                let text = [o.stdout, o.stderr].concat();
                String::from_utf8_lossy(&text)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            })
            .unwrap_or_default()
    };
    format!(
        "{}; {}; {}",
        first_line("haproxy", "-v"),
        first_line("nginx", "-v"),
        first_line("wrk", "-v")
    )
}

/// The shared test bed: a registrar, three nginx backends and their sidecars. Fields drop in
/// order: the processes go before their directory.
struct Bed {
    /// The rserpool binary: registrar, sidecars and the rserpool proxy.
    rserpool: PathBuf,
    dir: PathBuf,
    registrar: SocketAddr,
    backends: Vec<SocketAddr>,
    backend_procs: Vec<Option<Proc>>,
    others: Vec<Proc>,
    _tmp: TempDir,
}

impl Bed {
    fn start(sizes: &[usize], rserpool: &Path) -> Result<Bed> {
        // tmpfs, so that uploads cost memory copies, not disk writes.
        let dir = PathBuf::from(format!(
            "/dev/shm/rserpool-bench-proxy-{}",
            std::process::id()
        ));
        let www = dir.join("www");
        std::fs::create_dir_all(www.join("up"))?;
        let tmp = TempDir::new(dir.clone());
        std::fs::write(www.join(&SMALL[1..]), vec![b'x'; SMALL_SIZE])?;
        std::fs::write(www.join(&BULK[1..]), vec![0u8; BULK_SIZE])?;
        for &mib in sizes {
            std::fs::write(www.join(format!("m{mib}")), vec![0u8; mib * MB])?;
        }
        // nginx's workers may run as another user.
        use std::os::unix::fs::PermissionsExt;
        for d in [&dir, &www, &www.join("up")] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777))?;
        }
        let registrar = local(free_port()?);
        let mut others = vec![Proc::spawn(
            Command::new(rserpool)
                .args(["registrar", "--asap", &registrar.to_string()])
                .args(["--enrp", &local(free_port()?).to_string()])
                .env("RUST_LOG", "warn"),
            &dir.join("registrar.log"),
        )?];
        wait_for("the registrar", Duration::from_secs(5), || {
            std::net::TcpStream::connect(registrar).is_ok()
        })?;
        let mut bed = Bed {
            rserpool: rserpool.to_path_buf(),
            dir,
            registrar,
            backends: Vec::new(),
            backend_procs: Vec::new(),
            others: Vec::new(),
            _tmp: tmp,
        };
        for i in 0..BACKENDS {
            let addr = local(free_port()?);
            bed.backends.push(addr);
            bed.backend_procs.push(None);
            bed.start_backend(i)?;
            // The sidecar checks the second address, so its checks are not counted as
            // connection attempts in the failover run.
            others.push(Proc::spawn(
                Command::new(rserpool)
                    .args(["serve", "--target", &check_addr(addr).to_string()])
                    .args(["--advertise", &addr.to_string()])
                    .args(["--pool", POOL, "--id", &(i + 1).to_string()])
                    .args(["--registrar", &registrar.to_string()])
                    .env("RUST_LOG", "warn"),
                &bed.dir.join(format!("sidecar{i}.log")),
            )?);
        }
        bed.others = others;
        bed.wait_registered()?;
        Ok(bed)
    }

    fn start_backend(&mut self, i: usize) -> Result<()> {
        let addr = self.backends[i];
        let d = self.dir.display();
        let conf = format!(
            r#"daemon off;
master_process off;
pid {d}/b{i}.pid;
error_log {d}/b{i}.err error;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    default_type application/octet-stream;
    client_body_temp_path {d}/b{i}-body;
    proxy_temp_path {d}/b{i}-proxy;
    fastcgi_temp_path {d}/b{i}-fcgi;
    uwsgi_temp_path {d}/b{i}-uwsgi;
    scgi_temp_path {d}/b{i}-scgi;
    server {{
        listen {addr} backlog=4096;
        listen {check} backlog=64;
        root {d}/www;
        add_header X-Backend b{i} always;
        location /up/ {{
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 0;
            client_body_buffer_size 1m;
        }}
    }}
}}
"#,
            check = check_addr(addr),
        );
        let path = self.dir.join(format!("b{i}.conf"));
        std::fs::write(&path, conf)?;
        self.backend_procs[i] = None;
        let p = Proc::spawn(
            Command::new("nginx")
                .arg("-e")
                .arg(self.dir.join(format!("b{i}.err")))
                .arg("-c")
                .arg(&path),
            &self.dir.join(format!("b{i}.log")),
        )?;
        self.backend_procs[i] = Some(p);
        wait_for("an nginx backend", Duration::from_secs(5), || {
            std::net::TcpStream::connect(addr).is_ok()
        })
    }

    fn wait_registered(&self) -> Result<()> {
        wait_for(
            "the backends' registrations",
            Duration::from_secs(15),
            || registrar_status(self.registrar).is_ok_and(|s| s.pool_elements == BACKENDS),
        )
    }

    /// Every PUT run finds an empty upload directory and allocates its tmpfs pages afresh.
    fn clear_uploads(&self) -> Result<()> {
        for e in std::fs::read_dir(self.dir.join("www/up"))? {
            std::fs::remove_file(e?.path())?;
        }
        Ok(())
    }

    fn kill_backend(&mut self, i: usize) {
        if let Some(mut p) = self.backend_procs[i].take() {
            p.kill();
        }
    }
}

/// The address the sidecar checks: same port on 127.0.0.2.
fn check_addr(a: SocketAddr) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), a.port()))
}

/// A running system under test: where clients send HTTP and TCP-mode traffic.
struct Front {
    http: Vec<SocketAddr>,
    tcp: Vec<SocketAddr>,
    _proc: Option<Proc>,
}

fn start_front(bed: &Bed, system: System, threads: usize) -> Result<Front> {
    if system == System::Direct {
        return Ok(Front {
            http: bed.backends.clone(),
            tcp: bed.backends.clone(),
            _proc: None,
        });
    }
    let http = local(free_port()?);
    let tcp = local(free_port()?);
    let d = &bed.dir;
    let name = system.label().to_lowercase();
    let conf_path = d.join(format!("{name}.conf"));
    let servers = |line: &dyn Fn(usize, SocketAddr) -> String| {
        bed.backends
            .iter()
            .enumerate()
            .map(|(i, &b)| line(i, b) + "\n")
            .collect::<String>()
    };
    let mut cmd = match system {
        System::Direct => unreachable!("handled above"),
        System::Rserpool => {
            let conf = format!(
                r#"registrars = ["{reg}"]
threads = {threads}
max-connections = 20000

[[listener]]
listen = "{http}"
mode = "http"
pool = "{POOL}"

[[listener]]
listen = "{tcp}"
mode = "tcp"
pool = "{POOL}"
"#,
                reg = bed.registrar
            );
            std::fs::write(&conf_path, conf)?;
            let mut c = Command::new(&bed.rserpool);
            c.args(["proxy", "--config"])
                .arg(&conf_path)
                .env("RUST_LOG", "warn");
            c
        }
        System::Haproxy => {
            let conf = format!(
                r#"global
    nbthread {threads}
    maxconn 8000

defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    retries 3
    option redispatch

frontend web
    bind {http}
    option forwardfor
    http-reuse always
    default_backend pool

backend pool
    balance roundrobin
    http-reuse always
{servers}
listen tcp
    mode tcp
    bind {tcp}
    balance roundrobin
{servers}"#,
                servers = servers(&|i, b| format!("    server b{i} {b} check")),
            );
            std::fs::write(&conf_path, conf)?;
            let mut c = Command::new("haproxy");
            c.args(["-db", "-f"]).arg(&conf_path);
            c
        }
        System::Nginx => {
            let dd = d.display();
            let conf = format!(
                r#"load_module {STREAM_MODULE};
daemon off;
worker_processes {threads};
worker_rlimit_nofile 40000;
pid {dd}/nginx-proxy.pid;
error_log {dd}/nginx-proxy.err error;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dd}/np-body;
    proxy_temp_path {dd}/np-proxy;
    fastcgi_temp_path {dd}/np-fcgi;
    uwsgi_temp_path {dd}/np-uwsgi;
    scgi_temp_path {dd}/np-scgi;
    keepalive_requests 1000000;
    upstream pool {{
{servers}        keepalive 256;
    }}
    server {{
        listen {http} backlog=4096;
        client_max_body_size 0;
        location / {{
            proxy_pass http://pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_request_buffering off;
            proxy_max_temp_file_size 0;
            proxy_connect_timeout 1s;
        }}
    }}
}}
stream {{
    upstream tpool {{
{servers}    }}
    server {{
        listen {tcp} backlog=4096;
        proxy_pass tpool;
        proxy_connect_timeout 1s;
    }}
}}
"#,
                servers = servers(&|_, b| format!("        server {b};")),
            );
            std::fs::write(&conf_path, conf)?;
            let mut c = Command::new("nginx");
            c.arg("-e")
                .arg(d.join("nginx-proxy.err"))
                .arg("-c")
                .arg(&conf_path);
            c
        }
    };
    let proc = Proc::spawn(&mut cmd, &d.join(format!("{name}.log")))?;
    let front = Front {
        http: vec![http],
        tcp: vec![tcp],
        _proc: Some(proc),
    };
    // Ready when every backend has answered through it.
    let rt = client_runtime(1)?;
    let reached = rt.block_on(async {
        let start = Instant::now();
        let mut seen = std::collections::HashSet::new();
        while start.elapsed() < Duration::from_secs(15) && seen.len() < BACKENDS {
            if let Ok(mut c) = Client::connect(http).await {
                for _ in 0..2 * BACKENDS {
                    match tokio::time::timeout(Duration::from_secs(2), c.get(SMALL)).await {
                        Ok(Ok(r)) if r.code == 200 => {
                            seen.extend(r.header("x-backend"));
                        }
                        _ => break,
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen.len()
    });
    if reached < BACKENDS {
        bail!(
            "{} reached {reached} of {BACKENDS} backends within 15 s (see {})",
            system.label(),
            d.display()
        );
    }
    Ok(front)
}

fn client_runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?)
}

impl Sample {
    fn new(system: System, round: usize) -> Sample {
        Sample {
            system,
            round,
            keepalive: None,
            connect: None,
            bulk_mib_s: None,
            bulk_busy: None,
            bulk_link_mib_s: None,
            transfers: Vec::new(),
            failover: None,
        }
    }

    fn merge(&mut self, o: Sample) {
        self.keepalive = self.keepalive.or(o.keepalive);
        self.connect = self.connect.or(o.connect);
        self.bulk_mib_s = self.bulk_mib_s.or(o.bulk_mib_s);
        self.bulk_busy = self.bulk_busy.or(o.bulk_busy);
        self.bulk_link_mib_s = self.bulk_link_mib_s.or(o.bulk_link_mib_s);
        self.transfers.extend(o.transfers);
        self.failover = self.failover.take().or(o.failover);
    }
}

/// One part against one system, started afresh for it.
fn measure(
    bed: &mut Bed,
    s: &mut Sample,
    part: Part,
    sizes: &[usize],
    args: &ProxyBenchArgs,
) -> Result<()> {
    if part == Part::Failover && s.system == System::Direct {
        return Ok(());
    }
    let front = start_front(bed, s.system, args.threads)?;
    let url = format!("http://{}{SMALL}", front.http[0]);
    let rt = client_runtime(args.threads)?;
    match part {
        Part::Keepalive => s.keepalive = Some(wrk(&url, args, false, &front)?),
        Part::Connect => s.connect = Some(wrk(&url, args, true, &front)?),
        Part::Bulk => {
            let run = || {
                rt.block_on(bulk(
                    front.tcp.clone(),
                    args.bulk_connections,
                    Duration::from_secs(args.duration_s),
                ))
            };
            let ticks = machine_cpu_ticks();
            s.bulk_mib_s = Some(run()?);
            s.bulk_busy = machine_busy_since(ticks);
            if args.link_mbit > 0 {
                let _links = Links::limit(args.link_mbit, &bed.backends, &front.tcp)?;
                s.bulk_link_mib_s = Some(run()?);
            }
        }
        Part::Transfer => {
            for &mib in sizes {
                for method in ["PUT", "GET"] {
                    s.transfers.push(rt.block_on(transfer(
                        front.http.clone(),
                        method,
                        mib,
                        args.transfers,
                    ))?);
                    // Free the uploads' tmpfs pages and let the machine settle.
                    bed.clear_uploads()?;
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        Part::Failover => s.failover = Some(failover(bed, &front, &rt, args)?),
    }
    Ok(())
}

/// One wrk run; `close` sends `Connection: close` so that every request opens a connection.
fn wrk(url: &str, args: &ProxyBenchArgs, close: bool, front: &Front) -> Result<Wrk> {
    let group = front._proc.as_ref().map(Proc::id);
    let cpu0 = group.map(group_cpu_ns);
    let mut cmd = Command::new("wrk");
    cmd.args(["-t", &args.threads.to_string()])
        .args(["-c", &args.connections.max(args.threads).to_string()])
        .args(["-d", &format!("{}s", args.duration_s.max(1))])
        .arg("--latency");
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    let out = cmd.arg(url).output().context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk failed: {}{text}", String::from_utf8_lossy(&out.stderr));
    }
    let mut w = parse_wrk(&text).ok_or_else(|| anyhow!("cannot read wrk's output:\n{text}"))?;
    if let (Some(g), Some(c0)) = (group, cpu0) {
        let requests = w.rps * args.duration_s.max(1) as f64;
        w.cpu_us = Some((group_cpu_ns(g).saturating_sub(c0)) as f64 / 1e3 / requests.max(1.0));
    }
    Ok(w)
}

fn parse_wrk(text: &str) -> Option<Wrk> {
    let mut w = Wrk::default();
    let mut rps = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = t.strip_prefix("50%") {
            w.p50_ms = parse_duration_ms(v.trim())?;
        } else if let Some(v) = t.strip_prefix("99%") {
            w.p99_ms = parse_duration_ms(v.trim())?;
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            w.errors += v.trim().parse::<u64>().ok()?;
        } else if let Some(v) = t.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            for part in v.split(',') {
                w.errors += part.split_whitespace().nth(1)?.parse::<u64>().ok()?;
            }
        }
    }
    w.rps = rps?;
    Some(w)
}

fn parse_duration_ms(v: &str) -> Option<f64> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60e3)
    } else {
        return None;
    };
    Some(num.trim().parse::<f64>().ok()? * scale)
}

/// TCP mode bulk: connections loop over GETs of a large file for `d`; MiB/s of body.
async fn bulk(targets: Vec<SocketAddr>, conns: usize, d: Duration) -> Result<f64> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..conns.max(1) {
        let addr = targets[i % targets.len()];
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(addr).await?;
            let mut bytes = 0u64;
            while start.elapsed() < d {
                let r = c.get_counted(BULK).await?;
                if r.code != 200 || r.body_len != BULK_SIZE as u64 {
                    return Err(anyhow!("bulk GET: {} with {} bytes", r.code, r.body_len));
                }
                bytes += r.body_len;
            }
            Ok::<u64, anyhow::Error>(bytes)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / MB as f64 / start.elapsed().as_secs_f64())
}

/// Rate limits on loopback for the download direction, one per hop: everything the backends
/// send shares one class, everything the proxy's TCP listener sends another, each at `mbit`.
/// Dropping it removes the qdisc.
struct Links;

impl Links {
    fn limit(mbit: u64, backends: &[SocketAddr], front: &[SocketAddr]) -> Result<Links> {
        let shown = Command::new("tc")
            .args(["qdisc", "show", "dev", "lo"])
            .output()
            .context("running tc")?;
        let shown = String::from_utf8_lossy(&shown.stdout);
        if shown
            .lines()
            .any(|l| !l.trim().is_empty() && !l.contains("noqueue"))
        {
            bail!(
                "lo already has a qdisc ({}); remove it or use --link-mbit 0",
                shown.trim()
            );
        }
        let rate = format!("{mbit}mbit");
        // Before: deleting a qdisc that was never added does no harm.
        undo::lock().add_command(UNSHAPE);
        if let Err(e) = tc(&[
            "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1",
        ]) {
            undo::lock().remove_command(UNSHAPE);
            return Err(e);
        }
        let links = Links;
        tc(&[
            "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
        ])?;
        for class in ["1:2", "1:3"] {
            tc(&[
                "class", "add", "dev", "lo", "parent", "1:", "classid", class, "htb", "rate", &rate,
            ])?;
        }
        let hops = backends.iter().map(|b| (b, "1:2")).chain(
            front
                .iter()
                .filter(|f| !backends.contains(f))
                .map(|f| (f, "1:3")),
        );
        for (addr, class) in hops {
            tc(&[
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "sport",
                &addr.port().to_string(),
                "0xffff",
                "flowid",
                class,
            ])?;
        }
        Ok(links)
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        undo::lock().remove_command(UNSHAPE);
        let _ = tc(&UNSHAPE[1..]);
    }
}

/// Removes every rate limit from lo.
const UNSHAPE: undo::Command = &["tc", "qdisc", "del", "dev", "lo", "root"];

fn tc(args: &[&str]) -> Result<()> {
    let out = Command::new("tc")
        .args(args)
        .output()
        .context("running tc (iproute2; --link-mbit 0 skips the rate-limited run)")?;
    if !out.status.success() {
        bail!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The seed's experiment: `n` clients start one transfer each at the same moment.
async fn transfer(
    targets: Vec<SocketAddr>,
    method: &'static str,
    mib: usize,
    n: usize,
) -> Result<Transfer> {
    let size = mib * MB;
    let body = Arc::new(vec![0x5au8; if method == "PUT" { size } else { 0 }]);
    let mut clients = Vec::new();
    for i in 0..n {
        clients.push(Client::connect(targets[i % targets.len()]).await?);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, mut c) in clients.into_iter().enumerate() {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let ok = if method == "PUT" {
                c.put(&format!("/up/{i}"), &body)
                    .await
                    .is_ok_and(|r| (200..300).contains(&r.code))
            } else {
                c.get_counted(&format!("/m{mib}"))
                    .await
                    .is_ok_and(|r| r.code == 200 && r.body_len == size as u64)
            };
            (ok, t0.elapsed())
        }));
    }
    let mut times = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (ok, d) = t.await?;
        if !ok {
            failed += 1;
        }
        times.push(d.as_secs_f64());
    }
    Ok(Transfer {
        method,
        mib,
        avg_s: times.iter().sum::<f64>() / times.len().max(1) as f64,
        total_s: start.elapsed().as_secs_f64(),
        failed,
    })
}

/// Keep-alive GET load; a backend is killed after one second.
fn failover(
    bed: &mut Bed,
    front: &Front,
    rt: &tokio::runtime::Runtime,
    args: &ProxyBenchArgs,
) -> Result<Failover> {
    const VICTIM: usize = 1;
    let victim = bed.backends[VICTIM];
    let watch = SynWatch::start(victim.port())?;
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let addr = front.http[0];
    let tasks = (0..args.failover_clients.max(1))
        .map(|_| {
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            rt.spawn(async move {
                let mut c: Option<Client> = None;
                while !stop.load(Ordering::Relaxed) {
                    if c.is_none() {
                        c = Client::connect(addr).await.ok();
                    }
                    let Some(cl) = c.as_mut() else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    };
                    match tokio::time::timeout(Duration::from_secs(2), cl.get(SMALL)).await {
                        Ok(Ok(r)) if r.code == 200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if r.close {
                                c = None;
                            }
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            c = None;
                        }
                    }
                }
            })
        })
        .collect::<Vec<_>>();
    std::thread::sleep(Duration::from_secs(1));
    // Taken before the kill: the proxies react to the resets while the process is still
    // being torn down, before it can be reaped.
    let killed = Instant::now();
    bed.kill_backend(VICTIM);
    std::thread::sleep(Duration::from_millis(args.failover_ms));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        rt.block_on(t)?;
    }
    let syns = watch.finish()?;
    bed.start_backend(VICTIM)?;
    bed.wait_registered()?;
    let after: Vec<Instant> = syns.into_iter().filter(|&t| t >= killed).collect();
    let mut f = Failover {
        requests: ok.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        ..Failover::default()
    };
    if let Some(&first) = after.first() {
        let burst_end = after
            .windows(2)
            .position(|w| w[1] - w[0] >= Duration::from_millis(500))
            .map_or(after.len() - 1, |i| i);
        f.visible_ms = Some(ms(first - killed));
        f.off_ms = Some(ms(after[burst_end] - first));
        f.burst_connects = burst_end + 1;
        f.later_connects = after.len() - burst_end - 1;
        f.later_at_ms = after[burst_end + 1..]
            .iter()
            .map(|&t| ms(t - killed).round())
            .collect();
    }
    Ok(f)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Timestamps of connection attempts (SYN without ACK) to 127.0.0.1:`port`, from a raw
/// socket whose BPF filter passes nothing else (so a loaded loopback costs it nothing).
struct SynWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<std::io::Result<Vec<Instant>>>>,
}

fn raw_socket() -> Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::TCP))
        .context("the failover run needs a raw socket (run as root, or leave out --parts failover)")
}

impl SynWatch {
    fn start(port: u16) -> Result<SynWatch> {
        let s = raw_socket()?;
        s.attach_filter(&syn_filter(port))?;
        s.set_read_timeout(Some(Duration::from_millis(20)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::spawn(move || {
            use std::io::Read;
            let mut seen = Vec::new();
            let mut buf = [0u8; 128];
            while !st.load(Ordering::Relaxed) {
                match (&s).read(&mut buf) {
                    Ok(_) => seen.push(Instant::now()),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(seen)
        });
        Ok(SynWatch {
            stop,
            thread: Some(thread),
        })
    }

    fn finish(mut self) -> Result<Vec<Instant>> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self
            .thread
            .take()
            .ok_or_else(|| anyhow!("finished twice"))?;
        thread
            .join()
            .map_err(|_| anyhow!("the SYN watcher panicked"))?
            .context("reading the raw socket")
    }
}

impl Drop for SynWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Classic BPF over an IPv4 packet: destination 127.0.0.1, TCP destination `port`, flags
/// SYN without ACK.
fn syn_filter(port: u16) -> Vec<libc::sock_filter> {
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    vec![
        op(0x20, 0, 0, 16),              // ld [16]          (IP destination)
        op(0x15, 0, 7, 0x7f00_0001),     // jeq 127.0.0.1
        op(0xb1, 0, 0, 0),               // ldxb 4*([0]&0xf) (IP header length)
        op(0x48, 0, 0, 2),               // ldh [x+2]        (TCP destination port)
        op(0x15, 0, 4, u32::from(port)), // jeq port
        op(0x50, 0, 0, 13),              // ldb [x+13]       (TCP flags)
        op(0x54, 0, 0, 0x12),            // and SYN|ACK
        op(0x15, 0, 1, 0x02),            // jeq SYN
        op(0x06, 0, 0, 0xffff),          // accept
        op(0x06, 0, 0, 0),               // drop
    ]
}

fn print_sample(s: &Sample) {
    let mut line = format!("{:>8} round {}:", s.system.label(), s.round + 1);
    if let Some(w) = s.keepalive {
        line += &format!(
            " keep-alive {:.0} req/s p50 {:.2} ms p99 {:.2} ms ({} errors), {:.1} µs CPU/req;",
            w.rps,
            w.p50_ms,
            w.p99_ms,
            w.errors,
            w.cpu_us.unwrap_or(0.0)
        );
    }
    if let Some(w) = s.connect {
        line += &format!(
            " {:.0} conn/s ({} errors), {:.1} µs CPU/conn;",
            w.rps,
            w.errors,
            w.cpu_us.unwrap_or(0.0)
        );
    }
    if let Some(b) = s.bulk_mib_s {
        line += &format!(" TCP bulk {b:.0} MiB/s");
        if let Some(busy) = s.bulk_busy {
            line += &format!(" (machine {:.0} % busy)", 100.0 * busy);
        }
        line += ";";
    }
    if let Some(b) = s.bulk_link_mib_s {
        line += &format!(" over rate-limited hops {b:.1} MiB/s;");
    }
    for t in &s.transfers {
        line += &format!(
            " {} {} MiB avg {:.2} s total {:.2} s ({} failed);",
            t.method, t.mib, t.avg_s, t.total_s, t.failed
        );
    }
    if let Some(f) = &s.failover {
        line += &format!(
            " failover: {} of {} failed, visible {:?} ms, off {:?} ms, connects {} + {} (at {:?} ms)",
            f.failed,
            f.requests,
            f.visible_ms,
            f.off_ms,
            f.burst_connects,
            f.later_connects,
            f.later_at_ms
        );
    }
    println!("{line}");
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// A named figure of a row.
type Metric<'a> = (&'a str, &'a dyn Fn(&Row) -> Option<f64>);

/// (method, MiB)
type TransferKind = (&'static str, usize);
/// (average s, total s, failed transfers)
type TransferMedian = (f64, f64, usize);

/// Medians per system over the rounds.
struct Row {
    system: System,
    ka_rps: Option<f64>,
    ka_p50: Option<f64>,
    ka_p99: Option<f64>,
    ka_errors: u64,
    ka_cpu: Option<f64>,
    conn_s: Option<f64>,
    conn_cpu: Option<f64>,
    conn_errors: u64,
    bulk: Option<f64>,
    bulk_busy: Option<f64>,
    bulk_link: Option<f64>,
    transfers: Vec<(TransferKind, TransferMedian)>,
    failover: Vec<Failover>,
}

struct Report {
    rows: Vec<Row>,
    rounds: usize,
    link_mbit: u64,
}

impl Report {
    fn new(args: &ProxyBenchArgs, samples: &[Sample], sizes: &[usize]) -> Report {
        let rows = args
            .systems
            .iter()
            .map(|&system| {
                let of: Vec<&Sample> = samples.iter().filter(|s| s.system == system).collect();
                let m = |f: &dyn Fn(&Sample) -> Option<f64>| {
                    median(of.iter().filter_map(|s| f(s)).collect())
                };
                let mut transfers = Vec::new();
                for &mib in sizes {
                    for method in ["PUT", "GET"] {
                        let ts: Vec<&Transfer> = of
                            .iter()
                            .flat_map(|s| &s.transfers)
                            .filter(|t| t.method == method && t.mib == mib)
                            .collect();
                        if let (Some(a), Some(t)) = (
                            median(ts.iter().map(|t| t.avg_s).collect()),
                            median(ts.iter().map(|t| t.total_s).collect()),
                        ) {
                            let failed = ts.iter().map(|t| t.failed).sum();
                            transfers.push(((method, mib), (a, t, failed)));
                        }
                    }
                }
                Row {
                    system,
                    ka_rps: m(&|s| s.keepalive.map(|w| w.rps)),
                    ka_p50: m(&|s| s.keepalive.map(|w| w.p50_ms)),
                    ka_p99: m(&|s| s.keepalive.map(|w| w.p99_ms)),
                    ka_errors: of
                        .iter()
                        .filter_map(|s| s.keepalive)
                        .map(|w| w.errors)
                        .sum(),
                    ka_cpu: m(&|s| s.keepalive.and_then(|w| w.cpu_us)),
                    conn_s: m(&|s| s.connect.map(|w| w.rps)),
                    conn_cpu: m(&|s| s.connect.and_then(|w| w.cpu_us)),
                    conn_errors: of.iter().filter_map(|s| s.connect).map(|w| w.errors).sum(),
                    bulk: m(&|s| s.bulk_mib_s),
                    bulk_busy: m(&|s| s.bulk_busy),
                    bulk_link: m(&|s| s.bulk_link_mib_s),
                    transfers,
                    failover: of.iter().filter_map(|s| s.failover.clone()).collect(),
                }
            })
            .collect();
        Report {
            rows,
            rounds: args.repeat,
            link_mbit: args.link_mbit,
        }
    }

    /// The transfers measured, in the order they ran.
    fn transfer_kinds(&self) -> Vec<TransferKind> {
        let mut kinds = Vec::new();
        for (k, _) in self.rows.iter().flat_map(|r| &r.transfers) {
            if !kinds.contains(k) {
                kinds.push(*k);
            }
        }
        kinds
    }

    fn row(&self, s: System) -> Option<&Row> {
        self.rows.iter().find(|r| r.system == s)
    }

    fn markdown(&self, args: &ProxyBenchArgs, versions: &str) -> String {
        let mut md = String::new();
        let date = today();
        md += "### Results (`rserpool-bench proxy`)\n\n";
        md += &format!(
            "Command: `{}` ({date}). Machine: {}. {versions}.\n\n",
            command_line(),
            machine()
        );
        md += &format!(
            "Everything on this one machine over loopback: three nginx backends (one worker \
             each, a {SMALL_SIZE}-byte static file, large files, WebDAV PUT into tmpfs), each \
             registered by an `rserpool serve` sidecar; every proxy with {t} worker thread(s) \
             (rserpool `threads`, HAProxy `nbthread`, nginx `worker_processes`), round robin, \
             keep-alive to the backends (HAProxy `http-reuse always`, nginx `keepalive 256`), \
             X-Forwarded-For added by all three; wrk with {t} thread(s) and {c} connections for \
             {d} s. *Direct* is the client talking to the backends itself. Each part meets \
             the systems back to back, every proxy started afresh for it; medians of {r} \
             round(s).\n\n",
            t = args.threads,
            c = args.connections,
            d = args.duration_s,
            r = self.rounds
        );
        let cols: Vec<&Row> = self.rows.iter().collect();
        let header = |first: &str| {
            let mut h = format!("| {first} |");
            let mut sep = String::from("|---|");
            for r in &cols {
                h += &format!(" {} |", r.system.label());
                sep += "---|";
            }
            format!("{h}\n{sep}\n")
        };
        let line = |name: &str, f: &dyn Fn(&Row) -> String| {
            let mut l = format!("| {name} |");
            for r in &cols {
                l += &format!(" {} |", f(r));
            }
            l + "\n"
        };
        let num = |v: Option<f64>, prec: usize| v.map_or("–".into(), |v| format!("{v:.prec$}"));
        md += &header("");
        md += &line("keep-alive, req/s", &|r| num(r.ka_rps, 0));
        md += &line("keep-alive, p50 ms", &|r| num(r.ka_p50, 2));
        md += &line("keep-alive, p99 ms", &|r| num(r.ka_p99, 2));
        md += &line("keep-alive, errors (all rounds)", &|r| {
            r.ka_errors.to_string()
        });
        md += &line("keep-alive, proxy CPU µs per request", &|r| {
            num(r.ka_cpu, 1)
        });
        md += &line("new connection per request, conn/s", &|r| num(r.conn_s, 0));
        md += &line("new connection per request, errors (all rounds)", &|r| {
            r.conn_errors.to_string()
        });
        md += &line(
            "new connection per request, proxy CPU µs per connection",
            &|r| num(r.conn_cpu, 1),
        );
        md += &line(
            &format!(
                "TCP mode bulk, {} connections, MiB/s",
                args.bulk_connections
            ),
            &|r| num(r.bulk, 0),
        );
        md += &line("TCP mode bulk, machine CPU busy (all cores)", &|r| {
            r.bulk_busy
                .map_or("–".into(), |b| format!("{:.0} %", 100.0 * b))
        });
        if args.link_mbit > 0 {
            md += &line(
                &format!(
                    "TCP mode bulk, every hop limited to {} Mbit/s, MiB/s",
                    args.link_mbit
                ),
                &|r| num(r.bulk_link, 1),
            );
        }
        md += "\n";
        // Ratios.
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "–".into(),
        };
        let get = |s: System, f: &dyn Fn(&Row) -> Option<f64>| self.row(s).and_then(f);
        md += "| ratio | rserpool / HAProxy | rserpool / nginx | rserpool / direct | HAProxy / direct | nginx / direct |\n|---|---|---|---|---|---|\n";
        let metrics: [Metric; 7] = [
            ("keep-alive req/s", &|r: &Row| r.ka_rps),
            ("keep-alive p99 (lower is better)", &|r: &Row| r.ka_p99),
            (
                "keep-alive CPU per request (lower is better)",
                &|r: &Row| r.ka_cpu,
            ),
            ("conn/s", &|r: &Row| r.conn_s),
            ("CPU per connection (lower is better)", &|r: &Row| {
                r.conn_cpu
            }),
            ("TCP bulk MiB/s", &|r: &Row| r.bulk),
            ("TCP bulk over rate-limited hops", &|r: &Row| r.bulk_link),
        ];
        for (name, f) in metrics {
            let (d, rs, h, n) = (
                get(System::Direct, f),
                get(System::Rserpool, f),
                get(System::Haproxy, f),
                get(System::Nginx, f),
            );
            md += &format!(
                "| {name} | {} | {} | {} | {} | {} |\n",
                ratio(rs, h),
                ratio(rs, n),
                ratio(rs, d),
                ratio(h, d),
                ratio(n, d)
            );
        }
        md += "\n";
        if cols.iter().any(|r| !r.transfers.is_empty()) {
            md += &format!(
                "The seed paper's experiment (its Tables 2–3, 6–7): {} clients start one transfer \
                 each at the same moment; average time of a transfer / time until the last one \
                 finished, seconds (failed transfers in brackets when any). Direct clients \
                 spread over the three backends.\n\n",
                args.transfers
            );
            md += &header("transfer");
            for (method, mib) in self.transfer_kinds() {
                md += &line(&format!("{method} {mib} MiB"), &|r| {
                    r.transfers
                        .iter()
                        .find(|(k, _)| *k == (method, mib))
                        .map_or("–".into(), |(_, (a, t, failed))| {
                            let f = if *failed > 0 {
                                format!(" ({failed} failed)")
                            } else {
                                String::new()
                            };
                            format!("{a:.2} / {t:.2}{f}")
                        })
                });
            }
            md += "\n";
        }
        let fo: Vec<&Row> = cols
            .iter()
            .copied()
            .filter(|r| !r.failover.is_empty())
            .collect();
        if !fo.is_empty() {
            md += &format!(
                "Failover: {} keep-alive clients GET the small file through the proxy; after 1 s \
                 one backend is killed with SIGKILL and the run goes on for {} ms. Connection \
                 attempts to the dead backend are timestamped on a raw socket. *Visible*: kill → \
                 first refused attempt. *Traffic off*: first refused attempt → the last attempt \
                 before a pause of at least 500 ms. *Later*: attempts after that pause \
                 (back-off re-tries, health checks). One value per round.\n\n",
                args.failover_clients, args.failover_ms
            );
            md += "| | requests | failed | visible ms | traffic off ms | attempts in burst | later attempts |\n|---|---|---|---|---|---|---|\n";
            for r in fo {
                let all = |f: &dyn Fn(&Failover) -> String| {
                    r.failover.iter().map(f).collect::<Vec<_>>().join(", ")
                };
                let opt = |v: Option<f64>| v.map_or("no attempt".into(), |v| format!("{v:.0}"));
                md += &format!(
                    "| {} | {} | {} | {} | {} | {} | {} |\n",
                    r.system.label(),
                    all(&|f| f.requests.to_string()),
                    all(&|f| f.failed.to_string()),
                    all(&|f| opt(f.visible_ms)),
                    all(&|f| opt(f.off_ms)),
                    all(&|f| f.burst_connects.to_string()),
                    all(&|f| f.later_connects.to_string()),
                );
            }
            md += "\n";
        }
        md += &self.targets();
        md
    }

    fn targets(&self) -> String {
        let (Some(r), Some(h)) = (self.row(System::Rserpool), self.row(System::Haproxy)) else {
            return String::new();
        };
        let d = self.row(System::Direct);
        let verdict = |ok: Option<bool>| match ok {
            Some(true) => "met",
            Some(false) => "**not met**",
            None => "not measured",
        };
        let ge = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a >= b);
        let mut t = String::from("Targets of issue 5:\n\n");
        t += &format!(
            "- requests/s ≥ HAProxy's: {}\n- p99 ≤ HAProxy's: {}\n- connections/s ≥ HAProxy's: {}\n",
            verdict(ge(r.ka_rps, h.ka_rps)),
            verdict(ge(h.ka_p99, r.ka_p99)),
            verdict(ge(r.conn_s, h.conn_s)),
        );
        let of_direct = |a: Option<f64>, d: Option<f64>| {
            a.zip(d)
                .filter(|(_, d)| *d > 0.0)
                .map_or("–".into(), |(a, d)| format!("{:.2}×", a / d))
        };
        let direct_bulk = d.and_then(|d| d.bulk);
        t += "- TCP bulk ≥ 90 % of direct: ";
        if self.link_mbit > 0 {
            t += &format!(
                "{} where the network is the limit (every hop at {} Mbit/s, as on the seed's \
                 testbed: {} of direct); ",
                verdict(ge(
                    r.bulk_link,
                    d.and_then(|d| d.bulk_link).map(|b| 0.9 * b)
                )),
                self.link_mbit,
                of_direct(r.bulk_link, d.and_then(|d| d.bulk_link)),
            );
        }
        t += &format!(
            "{} on loopback ({} of direct), where direct alone keeps the machine {} busy and a \
             proxy's second TCP connection can only take from the same cores\n",
            verdict(ge(r.bulk, direct_bulk.map(|b| 0.9 * b))),
            of_direct(r.bulk, direct_bulk),
            d.and_then(|d| d.bulk_busy)
                .map_or("–".into(), |b| format!("{:.0} %", 100.0 * b)),
        );
        let fo = (!r.failover.is_empty()).then_some(&r.failover);
        t += &format!(
            "- zero failed requests when a PE dies: {}\n- traffic off a dead PE within 200 ms of the failure being visible: {}\n\n",
            verdict(fo.map(|f| f.iter().all(|f| f.failed == 0))),
            verdict(fo.map(|f| f.iter().all(|f| f.off_ms.is_none_or(|m| m <= 200.0)))),
        );
        t
    }

    fn plot(&self, prefix: &str) -> Result<()> {
        let direct = self.row(System::Direct);
        // Throughput relative to direct; direct's own bars (1.0) keep every system at the same
        // place and colour in all three charts.
        if let Some(d) = direct {
            let metrics: [Metric; 3] = [
                ("keep-alive req/s", &|r: &Row| r.ka_rps),
                ("new connection per request", &|r: &Row| r.conn_s),
                ("TCP bulk MiB/s", &|r: &Row| r.bulk),
            ];
            let groups: Vec<String> = metrics.iter().map(|m| m.0.to_string()).collect();
            let series: Vec<(String, Vec<f64>)> = self
                .rows
                .iter()
                .map(|r| {
                    let v = metrics
                        .iter()
                        .map(|(_, f)| match (f(r), f(d)) {
                            (Some(a), Some(b)) if b > 0.0 => a / b,
                            _ => 0.0,
                        })
                        .collect();
                    (r.system.label().to_string(), v)
                })
                .collect();
            plot::bars(
                &format!("{prefix}-throughput.png"),
                "Throughput through the proxy, relative to direct",
                "fraction of direct",
                &groups,
                &series,
            )?;
        }
        let series: Vec<(String, Vec<f64>)> = self
            .rows
            .iter()
            .map(|r| {
                (
                    r.system.label().to_string(),
                    vec![r.ka_p50.unwrap_or(0.0), r.ka_p99.unwrap_or(0.0)],
                )
            })
            .collect();
        plot::bars(
            &format!("{prefix}-latency.png"),
            "Keep-alive request latency (wrk)",
            "ms",
            &["p50".to_string(), "p99".to_string()],
            &series,
        )?;
        let kinds = self.transfer_kinds();
        if !kinds.is_empty() {
            let groups: Vec<String> = kinds.iter().map(|(m, s)| format!("{m} {s} MiB")).collect();
            let series: Vec<(String, Vec<f64>)> = self
                .rows
                .iter()
                .map(|r| {
                    let v = kinds
                        .iter()
                        .map(|k| {
                            r.transfers
                                .iter()
                                .find(|(kk, _)| kk == k)
                                .map_or(0.0, |(_, (a, _, _))| *a)
                        })
                        .collect();
                    (r.system.label().to_string(), v)
                })
                .collect();
            plot::bars(
                &format!("{prefix}-transfers.png"),
                "Average time of one of the concurrent transfers",
                "seconds",
                &groups,
                &series,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_output() {
        let out = "Running 5s test @ http://127.0.0.1:1/small.html
  1 threads and 50 connections
  Latency Distribution
     50%  770.00us
     75%    1.00ms
     99%    2.50ms
  265000 requests in 5.00s, 30.00MB read
  Non-2xx or 3xx responses: 12
  Socket errors: connect 1, read 2, write 0, timeout 3
Requests/sec:  53000.50
Transfer/sec:      6.00MB
";
        let w = parse_wrk(out).unwrap();
        assert_eq!(w.rps, 53000.5);
        assert!((w.p50_ms - 0.77).abs() < 1e-9);
        assert_eq!(w.p99_ms, 2.5);
        assert_eq!(w.errors, 18);
        assert!(parse_wrk("garbage").is_none());
    }
}
