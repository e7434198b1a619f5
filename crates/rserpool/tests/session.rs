//! The ASAP session layer end to end: `rserpool example calc` PEs (real processes, killed
//! with SIGKILL) and `rserpool session` pool users on loopback with a registrar; a forged
//! cookie; the business card; and the session messages on the wire, dissected by Wireshark.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use rserpool_wire::mapping::{self, Chunk, ChunkReader};
use rserpool_wire::{ASAP_PPID, AsapMessage, CauseCode, Message};
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const POOL: &str = "CalcPool";
const SECRET: &str = "calc pool secret";
/// The primes below 10^6.
const PRIMES_BELOW_1E6: &str = "result: 78498 primes below 1000000";

/// `rserpool example calc` as PE `id`, listening on `addr`; returns once it accepts.
async fn calc_pe(reg: SocketAddr, id: u32, addr: SocketAddr, extra: &[&str]) -> Logged {
    let mut args: Vec<String> = [
        "example",
        "calc",
        "--pool",
        POOL,
        "--id",
        &id.to_string(),
        "--listen",
        &addr.to_string(),
        "--registrar",
        &reg.to_string(),
        "--pool-secret",
        SECRET,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let pe = Logged::spawn(&format!("pe{id}"), &args, "info");
    wait_until(Duration::from_secs(10), "calc PE listening", || {
        std::net::TcpStream::connect(addr).is_ok()
    })
    .await;
    pe
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `rserpool session` with its standard output collected line by line.
struct SessionRun {
    proc: KillOnDrop,
    out: Arc<Mutex<Vec<String>>>,
}

impl SessionRun {
    fn start(reg: SocketAddr, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(["session", POOL, "--registrar", &reg.to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let lines = out.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
        });
        Self {
            proc: KillOnDrop(child),
            out,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.out.lock().unwrap().clone()
    }

    fn line_with(&self, needle: &str) -> Option<String> {
        self.lines().into_iter().find(|l| l.contains(needle))
    }

    async fn wait_line(&self, needle: &str, limit: Duration) -> String {
        wait_until(limit, needle, || self.line_with(needle).is_some()).await;
        self.line_with(needle).unwrap()
    }

    /// The PE the session started on.
    async fn first_pe(&self) -> u32 {
        let l = self
            .wait_line("session with PE ", Duration::from_secs(10))
            .await;
        hex_in(&l, "session with PE ")
    }

    /// Waits for the process to end successfully; returns its output.
    async fn finish(mut self, limit: Duration) -> Vec<String> {
        wait_until(limit, "session ends", || {
            self.proc.try_wait().unwrap().is_some()
        })
        .await;
        let status = self.proc.wait().unwrap();
        // The reader thread may still be draining the pipe.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let lines = self.lines();
        assert!(status.success(), "session failed: {lines:#?}");
        lines
    }
}

/// The hexadecimal number after `marker` in `line`.
fn hex_in(line: &str, marker: &str) -> u32 {
    let hex = &line[line.find(marker).unwrap() + marker.len() + 2..];
    let end = hex
        .find(|c: char| !c.is_ascii_hexdigit())
        .unwrap_or(hex.len());
    u32::from_str_radix(&hex[..end], 16).unwrap()
}

/// The numbers in `line` after `marker`, up to the first non-digit: "step 45/100" → 45.
fn number_after(line: &str, marker: &str) -> u64 {
    let s = &line[line.find(marker).unwrap() + marker.len()..];
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().unwrap()
}

async fn pool_size(status: SocketAddr) -> usize {
    registrar_status(status)
        .await
        .and_then(|s| s.pools.into_iter().find(|p| p.handle == POOL))
        .map_or(0, |p| p.pes.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_survives_sigkill_of_its_pe_and_resumes_from_the_last_cookie() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let mut pes = Vec::new();
    for id in 1..=3 {
        pes.push(calc_pe(reg, id, local(free_port()), &[]).await);
    }
    let status = r.status_addr().unwrap();
    wait_for(Duration::from_secs(10), "3 PEs registered", || async {
        pool_size(status).await == 3
    })
    .await;
    let s = SessionRun::start(reg, &[]);
    let first = s.first_pe().await;
    s.wait_line("progress 30/100", Duration::from_secs(20))
        .await;
    let victim = &pes[first as usize - 1];
    signal(&victim.proc, rustix::process::Signal::KILL);
    let out = s.finish(Duration::from_secs(30)).await;
    let text = out.join("\n");
    let failed = out
        .iter()
        .find(|l| l.starts_with("failed over from PE"))
        .unwrap_or_else(|| panic!("no failover in:\n{text}"));
    assert_eq!(hex_in(failed, "from PE "), first, "{text}");
    assert_ne!(hex_in(failed, "to PE "), first, "{text}");
    assert!(failed.contains("cookie echoed"), "{text}");
    let resumed = out
        .iter()
        .find(|l| l.starts_with("resumed at step"))
        .unwrap_or_else(|| panic!("no resumption in:\n{text}"));
    let from = number_after(resumed, "resumed at step ");
    let seen = number_after(resumed, "last progress seen ");
    // Cookies come every 5 steps: the job resumes at a cookie's step, at least 30 steps in,
    // and at most the steps since that cookie are computed twice.
    assert_eq!(from % 5, 0, "{text}");
    assert!(from >= 30, "{text}");
    assert!(seen >= from && seen - from <= 5, "{text}");
    assert!(text.contains(PRIMES_BELOW_1E6), "{text}");
    assert!(text.contains("1 failover,"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cookie_yet_the_job_starts_over_on_the_next_pe() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let mut pes = Vec::new();
    for id in 1..=2 {
        // No cookie before step 1000: the failover has nothing to echo.
        pes.push(calc_pe(reg, id, local(free_port()), &["--cookie-every", "1000"]).await);
    }
    let status = r.status_addr().unwrap();
    wait_for(Duration::from_secs(10), "2 PEs registered", || async {
        pool_size(status).await == 2
    })
    .await;
    let s = SessionRun::start(reg, &["--job", "300000"]);
    let first = s.first_pe().await;
    s.wait_line("progress 9/30", Duration::from_secs(20)).await;
    signal(&pes[first as usize - 1].proc, rustix::process::Signal::KILL);
    let text = s.finish(Duration::from_secs(30)).await.join("\n");
    assert!(text.contains("no cookie yet: job restarted"), "{text}");
    // π(300000) = 25997.
    assert!(text.contains("result: 25997 primes below 300000"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_pe_is_left_after_the_response_timeout_and_a_slow_one_is_not() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let status = r.status_addr().unwrap();
    // Steps of 700 ms: the pool user hears nothing for longer than its heartbeat interval,
    // so only the PE's heartbeat answers keep the session where it is.
    let slow = ["--step-ms", "700", "--cookie-every", "1"];
    let mut pes = Vec::new();
    for id in 1..=2 {
        pes.push(calc_pe(reg, id, local(free_port()), &slow).await);
    }
    wait_for(Duration::from_secs(10), "2 PEs registered", || async {
        pool_size(status).await == 2
    })
    .await;
    let timeouts = ["--heartbeat-ms", "100", "--response-timeout-ms", "400"];
    let mut args = vec!["--job", "40000"];
    args.extend(timeouts);
    let s = SessionRun::start(reg, &args);
    let first = s.first_pe().await;
    s.wait_line("progress 2/4", Duration::from_secs(20)).await;
    // Stopped, not dead: its connection stays open and silent.
    let hung = &pes[first as usize - 1].proc;
    signal(hung, rustix::process::Signal::STOP);
    let text = s.finish(Duration::from_secs(30)).await.join("\n");
    signal(hung, rustix::process::Signal::CONT);
    assert!(
        text.contains("after no answer within the response timeout"),
        "{text}"
    );
    assert!(text.contains("1 failover,"), "{text}");
    // π(40000) = 4203.
    assert!(text.contains("result: 4203 primes below 40000"), "{text}");
}

/// Reads chunks from `s` until an ASAP message arrives (or the stream ends: `None`).
async fn next_asap(s: &mut TcpStream, r: &mut ChunkReader) -> Option<AsapMessage> {
    loop {
        while let Some(c) = r.next_chunk().unwrap() {
            if let Chunk::Data { ppid, payload, .. } = c
                && ppid == ASAP_PPID
            {
                return Some(AsapMessage::decode(&payload).unwrap());
            }
        }
        if s.read_buf(r.buffer_mut()).await.unwrap_or(0) == 0 {
            return None;
        }
    }
}

/// Opens a data channel to `pe` and sends COOKIE_ECHO with `cookie` first; returns what the
/// PE answers before it closes.
async fn echo_cookie(pe: SocketAddr, cookie: Vec<u8>) -> Vec<AsapMessage> {
    let mut s = TcpStream::connect(pe).await.unwrap();
    let mut out = bytes::BytesMut::new();
    mapping::put_init(&mut out);
    let mut m = Vec::new();
    AsapMessage::CookieEcho {
        cookie: cookie.into(),
    }
    .encode(&mut m)
    .unwrap();
    mapping::put_data(&mut out, ASAP_PPID, &m);
    s.write_all(&out).await.unwrap();
    let mut r = ChunkReader::new();
    let mut got = Vec::new();
    let read = async {
        while let Some(m) = next_asap(&mut s, &mut r).await {
            got.push(m);
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the PE closes the session after refusing the cookie");
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_cookie_is_refused_and_other_sessions_go_on() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let addr = local(free_port());
    let pe = calc_pe(reg, 1, addr, &[]).await;
    let s = SessionRun::start(reg, &["--job", "500000"]);
    s.wait_line("progress 10/50", Duration::from_secs(20)).await;

    // A cookie made up by the pool user: sealed kind, a state that skips the job to its
    // end, and a tag without the secret.
    let mut forged = vec![1u8];
    forged.extend_from_slice(&0u64.to_be_bytes());
    forged.extend_from_slice(b"calc1 500000 50 999999");
    forged.extend_from_slice(&[0u8; 32]);
    // An unsealed one.
    let mut unsealed = vec![0u8];
    unsealed.extend_from_slice(&0u64.to_be_bytes());
    unsealed.extend_from_slice(b"calc1 500000 50 999999");
    for cookie in [forged, unsealed] {
        let answers = echo_cookie(addr, cookie).await;
        let [AsapMessage::Error { error }] = &answers[..] else {
            panic!("expected one ASAP ERROR, got {answers:?}");
        };
        assert_eq!(error.causes[0].code, CauseCode::REJECTED_SECURITY);
    }
    // Not the TCP mapping at all: closed.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let mut r = ChunkReader::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), next_asap(&mut plain, &mut r)).await;
    assert!(matches!(closed, Ok(None)), "{closed:?}");

    let text = s.finish(Duration::from_secs(30)).await.join("\n");
    // π(500000) = 41538.
    assert!(text.contains("result: 41538 primes below 500000"), "{text}");
    let refused = pe.lines_with("COOKIE_ECHO refused");
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[0].contains("tag does not match"), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_business_card_names_the_pe_to_fail_over_to() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let status = r.status_addr().unwrap();
    let (a1, a2, a3) = (local(free_port()), local(free_port()), local(free_port()));
    let card = format!("3@{a3}");
    let pe1 = calc_pe(reg, 1, a1, &["--business-card", &card]).await;
    wait_for(Duration::from_secs(10), "PE 1 registered", || async {
        pool_size(status).await == 1
    })
    .await;
    let s = SessionRun::start(reg, &[]);
    assert_eq!(s.first_pe().await, 1);
    // PE 2 registers before PE 3: by round robin alone the session would move there.
    let _pe2 = calc_pe(reg, 2, a2, &[]).await;
    wait_for(Duration::from_secs(10), "PE 2 registered", || async {
        pool_size(status).await == 2
    })
    .await;
    let _pe3 = calc_pe(reg, 3, a3, &[]).await;
    s.wait_line("progress 30/100", Duration::from_secs(20))
        .await;
    signal(&pe1.proc, rustix::process::Signal::KILL);
    let text = s.finish(Duration::from_secs(30)).await.join("\n");
    assert!(
        text.contains("failed over from PE 0x00000001 to PE 0x00000003"),
        "{text}"
    );
    assert!(text.contains(PRIMES_BELOW_1E6), "{text}");
}

/// Copies `r` to `w`, recording what passed in `log`.
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    log: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 65536];
    loop {
        let n = r.read(&mut buf).await.unwrap_or(0);
        if n == 0 || w.write_all(&buf[..n]).await.is_err() {
            return;
        }
        log.lock().unwrap().extend_from_slice(&buf[..n]);
    }
}

/// A TCP relay in front of `backend` that records what flows each way; [`cut`](Self::cut)
/// breaks every connection through it, like a PE that dies.
struct Recorder {
    addr: SocketAddr,
    /// Bytes towards the PE, and back towards the PU.
    up: Arc<Mutex<Vec<u8>>>,
    down: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    async fn start(backend: SocketAddr) -> Self {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let up: Arc<Mutex<Vec<u8>>> = Arc::default();
        let down: Arc<Mutex<Vec<u8>>> = Arc::default();
        let (u, d) = (up.clone(), down.clone());
        let task = tokio::spawn(async move {
            // Dropped with the task: every relayed connection ends with it.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let (client, _) = l.accept().await.unwrap();
                let server = TcpStream::connect(backend).await.unwrap();
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                conns.spawn(pump(cr, sw, u.clone()));
                conns.spawn(pump(sr, cw, d.clone()));
            }
        });
        Self {
            addr,
            up,
            down,
            task,
        }
    }

    fn cut(&self) {
        self.task.abort();
    }

    /// The ASAP messages (PPID 11) recorded in one direction, as sent.
    fn asap(&self, towards_pe: bool) -> Vec<Vec<u8>> {
        let bytes = if towards_pe { &self.up } else { &self.down };
        let mut r = ChunkReader::new();
        r.buffer_mut().extend_from_slice(&bytes.lock().unwrap());
        let mut out = Vec::new();
        while let Some(c) = r.next_chunk().unwrap() {
            if let Chunk::Data { ppid, payload, .. } = c
                && ppid == ASAP_PPID
            {
                out.push(payload.to_vec());
            }
        }
        out
    }
}

/// A library PE of the pool behind a [`Recorder`], registered at the recorder's address.
async fn recorded_pe(
    reg: SocketAddr,
    id: u32,
) -> (
    rserpool_asap::PoolElement,
    Recorder,
    tokio::net::TcpListener,
) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rec = Recorder::start(l.local_addr().unwrap()).await;
    let mut cfg =
        rserpool_asap::PoolElementConfig::new(POOL, rec.addr, rserpool_wire::Policy::RoundRobin);
    cfg.id = Some(id);
    cfg.registrars = vec![reg];
    let pe = rserpool_asap::PoolElement::start(cfg).unwrap();
    pe.wait_registered(Duration::from_secs(5)).await.unwrap();
    (pe, rec, l)
}

/// The tools, or `false` after saying why not (an error under CI).
fn wireshark_available() -> bool {
    let ok = ["tshark", "text2pcap"].iter().all(|t| {
        Command::new(t)
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    assert!(
        ok || !ci,
        "CI is set but tshark/text2pcap are not installed"
    );
    if !ok {
        eprintln!("SKIPPED: tshark not installed (apt-get install tshark)");
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_echo_and_business_card_on_the_data_channel_decode_in_wireshark() {
    use rserpool_asap::session::*;
    if !wireshark_available() {
        return;
    }
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let (_pe_a, rec_a, l_a) = recorded_pe(reg, 0xa).await;
    let sealer = CookieSealer::new(POOL.into(), vec![SECRET.as_bytes().to_vec()]);
    let acceptor = SessionAcceptor::new(sealer);

    // PE A: a business card naming PE B, a cookie, a greeting; then it "dies" (cut).
    let acc = acceptor.clone();
    let card_target = rserpool_wire::PoolElement {
        id: 0xb,
        home_registrar: 0,
        registration_life: -1,
        user_transport: rserpool_wire::UserTransport::Address(
            rserpool_wire::TransportAddress::tcp("127.0.0.1:9".parse().unwrap()),
        ),
        policy: rserpool_wire::Policy::RoundRobin,
        asap_transport: None,
    };
    let card = vec![card_target];
    let a = tokio::spawn(async move {
        let (stream, _) = l_a.accept().await.unwrap();
        let s = acc.accept(stream);
        s.send_business_card(POOL.into(), Some(rserpool_wire::Policy::RoundRobin), card)
            .await
            .unwrap();
        s.send_cookie(b"state 1").await.unwrap();
        s.send(b"hello").await.unwrap();
        s
    });
    let pu_cfg = rserpool_asap::PoolUserConfig {
        registrars: vec![reg],
        ..Default::default()
    };
    let pu = rserpool_asap::PoolUser::new(pu_cfg).unwrap();
    let mut session = Session::connect(pu, SessionConfig::new(POOL))
        .await
        .unwrap();
    let SessionEvent::Message { data, .. } = session.recv().await.unwrap() else {
        panic!("expected the greeting");
    };
    assert_eq!(&data[..], b"hello");
    let (_pe_b, rec_b, l_b) = recorded_pe(reg, 0xb).await;
    let b = tokio::spawn(async move {
        let (stream, _) = l_b.accept().await.unwrap();
        let mut s = acceptor.accept(stream);
        let Some(PeSessionEvent::Resume(state)) = s.recv().await.unwrap() else {
            panic!("expected COOKIE_ECHO first");
        };
        assert_eq!(&state[..], b"state 1");
        s.send(b"resumed").await.unwrap();
        s
    });
    let _a = a.await.unwrap();
    rec_a.cut();
    // The card names B at a port where nothing listens: the pool (by the registrar) is next.
    let SessionEvent::FailedOver(f) = session.recv().await.unwrap() else {
        panic!("expected a failover");
    };
    assert!(f.cookie_echoed);
    assert_eq!((f.from, f.to), (0xa, 0xb));
    let SessionEvent::Message { data, .. } = session.recv().await.unwrap() else {
        panic!("expected B's answer");
    };
    assert_eq!(&data[..], b"resumed");
    let _b = b.await.unwrap();

    // What went over the wire: BUSINESS_CARD and COOKIE from A, COOKIE_ECHO to B.
    let mut messages = rec_a.asap(false);
    messages.extend(rec_b.asap(true));
    assert_eq!(messages.len(), 3, "{messages:?}");
    let dir = std::env::temp_dir().join(format!("rserpool-session-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hex: String = messages
        .iter()
        .map(|m| {
            let bytes: Vec<String> = m.iter().map(|b| format!("{b:02x}")).collect();
            format!("0000  {}\n", bytes.join(" "))
        })
        .collect();
    std::fs::write(dir.join("session.txt"), hex).unwrap();
    // In SCTP with PPID 11, as over SCTP; Wireshark has no dissector for the TCP mapping.
    let st = Command::new("text2pcap")
        .args(["-q", "-S", "3863,3863,11"])
        .arg(dir.join("session.txt"))
        .arg(dir.join("session.pcap"))
        .status()
        .unwrap();
    assert!(st.success());
    let fields = Command::new("tshark")
        .args(["-n", "-r"])
        .arg(dir.join("session.pcap"))
        .args([
            "-T",
            "fields",
            "-e",
            "asap.message_type",
            "-e",
            "asap.pool_handle_pool_handle",
            "-e",
            "asap.pool_element_pe_identifier",
            "-e",
            "asap.cookie",
            "-e",
            "_ws.malformed",
            "-e",
            "_ws.expert",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let out = String::from_utf8_lossy(&fields.stdout);
    let rows: Vec<Vec<&str>> = out.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 3, "{out}");
    // BUSINESS_CARD (13) for the pool, naming PE 0xb.
    assert_eq!(rows[0][0], "13", "{out}");
    assert_eq!(rows[0][1], hex_of(POOL.as_bytes()), "{out}");
    assert_eq!(rows[0][2], "0x0000000b", "{out}");
    // COOKIE (11) from A and COOKIE_ECHO (12) to B carry the same bytes.
    assert_eq!((rows[1][0], rows[2][0]), ("11", "12"), "{out}");
    assert!(!rows[1][3].is_empty() && rows[1][3] == rows[2][3], "{out}");
    for row in &rows {
        assert!(
            row[4..].iter().all(|f| f.is_empty()),
            "malformed or expert info: {out}"
        );
    }
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
