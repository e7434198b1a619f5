//! The ASAP session layer end to end: `rserpool example calc` PEs (real processes, killed
//! with SIGKILL) and `rserpool session` pool users on loopback with a registrar; a forged
//! cookie; the business card; and the session messages on the wire, dissected by Wireshark.

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
    let end = hex.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(hex.len());
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
    s.wait_line("progress 30/100", Duration::from_secs(20)).await;
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

/// Reads chunks from `s` until an ASAP message arrives (or the stream ends: `None`).
async fn next_asap(s: &mut TcpStream, r: &mut ChunkReader) -> Option<AsapMessage> {
    loop {
        while let Some(c) = r.next_chunk().unwrap() {
            if let Chunk::Data { ppid, payload, .. } = c {
                if ppid == ASAP_PPID {
                    return Some(AsapMessage::decode(&payload).unwrap());
                }
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
    plain
        .write_all(b"GET / HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
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
    s.wait_line("progress 30/100", Duration::from_secs(20)).await;
    signal(&pe1.proc, rustix::process::Signal::KILL);
    let text = s.finish(Duration::from_secs(30)).await.join("\n");
    assert!(
        text.contains("failed over from PE 0x00000001 to PE 0x00000003"),
        "{text}"
    );
    assert!(text.contains(PRIMES_BELOW_1E6), "{text}");
}
