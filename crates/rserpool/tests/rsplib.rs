//! rserpool and rsplib, the other RSerPool implementation, in one system over SCTP — in UDP
//! (`sctp+udp://`, RFC 6951) and as IP protocol 132 on raw sockets (`sctp://`) — both ways:
//! - rsplib's pool elements (`rspserver -echo`) register at `rserpool registrar`,
//!   `rserpool resolve` and the status page list them, rsplib's pool user (`rspterminal`)
//!   resolves the pool through our registrar and is echoed by a PE, and a PE killed without a
//!   word is removed by our registrar's keep-alives;
//! - our pool elements (`rserpool example echo` over SCTP) register at `rspregistrar`,
//!   rsplib's `hsdump` lists them, our pool user (`rserpool resolve`) resolves them at
//!   rsplib's registrar over SCTP, `rspterminal` is echoed by them, and one stopped
//!   deregisters.
//!
//! Every frame on the bridge is captured and decoded by tshark: ASAP (and ENRP where hsdump
//! asks) decoded inside SCTP, no malformed frame, every CRC32c good.
//!
//! rsplib runs on its user-space SCTP stack (sctplib) as separate processes, built by the
//! interoperability script into `target/rsplib-udp` and `target/rsplib-raw` (`.ci/run` does).
//! sctplib reads every UDP (or SCTP) packet of its network namespace, so each rsplib process
//! gets a namespace of its own, all on one bridge with TEST-NET addresses (rsplib's PEs refuse
//! loopback). Needs root; without it or the peer the test says SKIPPED (and fails under `CI`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::bridge::Net;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rserpool");

/// How SCTP travels: rsplib is built for one or the other.
#[derive(Clone, Copy)]
enum Carrier {
    Udp,
    Raw,
}

impl Carrier {
    fn scheme(self) -> &'static str {
        match self {
            Carrier::Udp => "sctp+udp",
            Carrier::Raw => "sctp",
        }
    }

    fn build(self) -> &'static str {
        match self {
            Carrier::Udp => "rsplib-udp",
            Carrier::Raw => "rsplib-raw",
        }
    }

    fn bin(self, name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../target")
            .join(self.build())
            .join("bin")
            .join(name)
    }
}

/// Whether the test can run; under `CI` a missing piece fails it.
fn runnable(c: Carrier) -> bool {
    if !rustix::process::geteuid().is_root() {
        return !rserpool_ksplice::testbed::skip("the rsplib test needs root (network namespaces)");
    }
    c.bin("rspserver").exists()
        || !rserpool_ksplice::testbed::skip(&format!(
            "rsplib is not built in target/{} (.ci/run builds it)",
            c.build()
        ))
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An rsplib program in namespace `ns`, logging into `log`.
fn rsplib(c: Carrier, ns: &str, name: &str, args: &[&str], log: &Path) -> Kill {
    Kill(
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(c.bin(name))
            .args(args)
            .args(["-loglevel=3", "-logcolor=off"])
            .arg(format!("-logfile={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// `rserpool ARGS` in `ns`: its standard output.
fn rserpool_out(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, BIN])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `check` holds, or fails with what it last saw.
fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> (bool, String)) {
    let start = Instant::now();
    loop {
        let (ok, seen) = check();
        if ok {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what} within {limit:?}; saw:\n{seen}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The lines of `rserpool resolve` (asking `registrar`) listing PEs over SCTP.
fn sctp_pes(ns: &str, registrar: &str, pool: &str) -> (Vec<String>, String) {
    let out = rserpool_out(
        ns,
        &["resolve", "--registrar", registrar, "--items", "10", pool],
    );
    let pes = out
        .lines()
        .filter(|l| l.contains(" sctp "))
        .map(str::to_string)
        .collect();
    (pes, out)
}

/// What rsplib's `hsdump` in `ns` prints of the handlespace of the registrar whose ENRP
/// address is `registrar` (at most 10 s).
fn hsdump(c: Carrier, ns: &str, registrar: &str) -> String {
    let out = Command::new("timeout")
        .args(["10", "ip", "netns", "exec", ns])
        .arg(c.bin("hsdump"))
        .args([registrar, "-logcolor=off", "-loglevel=0"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What `rspterminal` in `ns` prints after sending `line` to pool EchoPool through the
/// registrar at 192.0.2.1 (up to 15 s, until the line comes back).
fn rspterminal(c: Carrier, ns: &str, line: &str) -> String {
    let mut terminal = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(c.bin("rspterminal"))
        .args([
            "-poolhandle=EchoPool",
            "-registrar=192.0.2.1:3863",
            "-loglevel=0",
            "-logcolor=off",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = terminal.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, format!("{line}\n").as_bytes()).unwrap();
    let mut stdout = terminal.stdout.take().unwrap();
    let needle = line.to_string();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            match std::io::Read::read(&mut stdout, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
            if String::from_utf8_lossy(&seen).contains(&needle) {
                break;
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(stdin);
    let _ = terminal.kill();
    let _ = terminal.wait();
    reader.join().unwrap()
}

/// `rserpool registrar` in namespace `ns` as host `i` of the bridge (`Net::addr`), listening
/// on TCP and `scheme` for ASAP and ENRP, peered with host `peer` over `scheme`; quick to
/// take over, with keep-alives often enough to show that the network works.
fn our_registrar(ns: &str, scheme: &str, i: usize, peer: Option<usize>, log: &Path) -> Kill {
    let me = Net::addr(i);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, BIN, "registrar"])
        .args(["--asap", &format!("tcp://{me}:3863,{scheme}://{me}:3863")])
        .args(["--enrp", &format!("tcp://{me}:9901,{scheme}://{me}:9901")])
        .args(["--max-time-last-heard-ms", "1000"])
        .args(["--max-time-no-response-ms", "1000"])
        .args(["--keep-alive-interval-ms", "300"])
        .args(["--keep-alive-timeout-ms", "1000"]);
    if let Some(p) = peer {
        cmd.args(["--peer", &format!("{scheme}://{}:9901", Net::addr(p))]);
    }
    Kill(
        cmd.env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// A test's namespaces, its log directory (kept with `RSPLIB_TEST_KEEP=1`) and the capture
/// on the first namespace's bridge.
fn setup(hosts: usize, name: &str) -> (Net, PathBuf, Capture) {
    let net = Net::new(hosts);
    let logs = std::env::temp_dir().join(format!("rsplib-interop-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let capture = Capture::start(&net.names[0], logs.join("capture.pcapng"));
    (net, logs, capture)
}

/// Logs and captures are kept with `RSPLIB_TEST_KEEP=1`.
fn remove_logs(dir: &Path) {
    if std::env::var_os("RSPLIB_TEST_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        eprintln!("logs and capture kept in {}", dir.display());
    }
}

/// Everything on the bridge of `ns` into a file, until [`Capture::decode`].
struct Capture {
    child: Kill,
    file: PathBuf,
}

impl Capture {
    fn start(ns: &str, file: PathBuf) -> Capture {
        let child = Kill(
            Command::new("ip")
                .args(["netns", "exec", ns, "dumpcap", "-q", "-i", "br0", "-w"])
                .arg(&file)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut c = Capture { child, file };
        // dumpcap says "Capturing on 'br0'" once it does.
        let mut err = c.child.0.stderr.take().unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 256];
        let start = Instant::now();
        while !String::from_utf8_lossy(&seen).contains("Capturing on") {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "dumpcap did not start"
            );
            match std::io::Read::read(&mut err, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        let log = c.file.with_extension("log");
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(log).unwrap();
            std::io::copy(&mut err, &mut f)
        });
        c
    }

    /// Stops the capture; every frame's protocols, CRC32c status and malformed marks.
    fn decode(mut self) -> Vec<String> {
        // libpcap hands packets over in blocks, at the latest after its 1 s buffer timeout,
        // and dumpcap drops an unfinished block when interrupted: let the last one go first.
        std::thread::sleep(Duration::from_millis(1500));
        let pid = rustix::process::Pid::from_child(&self.child.0);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        let _ = self.child.0.wait();
        let out = Command::new("tshark")
            .args(["-n", "-r"])
            .arg(&self.file)
            .args([
                "-o",
                "sctp.checksum:CRC-32C",
                "-T",
                "fields",
                "-E",
                "separator=|",
            ])
            .args(["-e", "frame.protocols", "-e", "sctp.checksum.status"])
            .args(["-e", "_ws.malformed", "-e", "ip.src"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// The capture of a test: SCTP with ASAP inside (and ENRP if `enrp`); from rserpool's hosts
/// (`ours`), nothing malformed and every checksum good. rsplib's malformed frames are listed:
/// sctplib sends an empty DATA chunk (no user data, which RFC 9260 §6.2 forbids) to a peer it
/// lost, which tshark calls a malformed ASAP message.
fn assert_clean(frames: &[String], enrp: bool, ours: &[&str]) {
    let sctp: Vec<&String> = frames.iter().filter(|f| f.contains(":sctp")).collect();
    let asap = sctp.iter().filter(|f| f.contains(":asap")).count();
    assert!(
        asap > 0,
        "no ASAP decoded in {} frames: {frames:#?}",
        frames.len()
    );
    if enrp {
        assert!(
            sctp.iter().any(|f| f.contains(":enrp")),
            "no ENRP decoded: {frames:#?}"
        );
    }
    let (bad, theirs): (Vec<&&String>, Vec<&&String>) = sctp
        .iter()
        .filter(|f| {
            let cols: Vec<&str> = f.split('|').collect();
            // Checksum status 1 is "Good"; a malformed mark is bad.
            cols.get(1)
                .is_some_and(|c| !c.is_empty() && !c.split(',').all(|s| s == "1"))
                || cols.get(2).is_some_and(|c| !c.is_empty())
        })
        .partition(|f| ours.iter().any(|ip| f.ends_with(&format!("|{ip}"))));
    assert!(
        bad.is_empty(),
        "frames from rserpool with a bad checksum or malformed: {bad:#?}"
    );
    eprintln!(
        "capture: {} SCTP frames, {asap} with ASAP, none of rserpool's malformed; rsplib's: {theirs:?}",
        sctp.len()
    );
}

/// A test over SCTP in UDP and one over SCTP on raw IP, each with rsplib built for it.
macro_rules! both_carriers {
    ($udp:ident, $raw:ident, $body:ident) => {
        #[test]
        fn $udp() {
            $body(Carrier::Udp);
        }

        #[test]
        fn $raw() {
            $body(Carrier::Raw);
        }
    };
}

both_carriers!(
    rsplib_pool_elements_register_at_our_registrar_over_sctp_in_udp,
    rsplib_pool_elements_register_at_our_registrar_over_sctp_on_raw_ip,
    rsplib_pool_elements_at_our_registrar
);

both_carriers!(
    our_pool_elements_register_at_rsplibs_registrar_over_sctp_in_udp,
    our_pool_elements_register_at_rsplibs_registrar_over_sctp_on_raw_ip,
    our_pool_elements_at_rsplibs_registrar
);

fn rsplib_pool_elements_at_our_registrar(c: Carrier) {
    if !runnable(c) {
        return;
    }
    // h0: our registrar; h1, h2: rsplib PEs; h3: rsplib's pool user.
    let (net, logs, capture) = setup(4, &format!("{}-a", c.build()));
    let reg = &net.names[0];
    let _registrar = our_registrar(reg, c.scheme(), 0, None, &logs.join("registrar.log"));
    let pe = |i: usize| {
        rsplib(
            c,
            &net.names[i],
            "rspserver",
            &[
                "-echo",
                "-poolhandle=EchoPool",
                "-registrar=192.0.2.1:3863",
                &format!("-local={}:7777", Net::addr(i)),
            ],
            &logs.join(format!("pe{i}.log")),
        )
    };
    let mut pe1 = Some(pe(1));
    let _pe2 = pe(2);

    // Both registered over SCTP: the registrar lists them with their SCTP transport.
    wait_until(
        "both rsplib PEs listed by `rserpool resolve`",
        Duration::from_secs(20),
        || {
            let (pes, out) = sctp_pes(reg, "192.0.2.1:3863", "EchoPool");
            let both = pes.iter().any(|l| l.contains("192.0.2.2:7777"))
                && pes.iter().any(|l| l.contains("192.0.2.3:7777"));
            (both, out)
        },
    );
    let status = Command::new("ip")
        .args([
            "netns",
            "exec",
            reg,
            "curl",
            "-s",
            "http://127.0.0.1:8863/status",
        ])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains("EchoPool") && status.contains("192.0.2.2") && status.contains("192.0.2.3"),
        "the status page lists the pool and both PEs: {status}"
    );

    // rsplib's hsdump dumps our registrar's handlespace over ENRP (it lists its loopback
    // addresses first: our registrar answers over the association it asked on).
    wait_until(
        "both rsplib PEs listed by hsdump at our registrar",
        Duration::from_secs(30),
        || {
            let out = hsdump(c, &net.names[3], "192.0.2.1:9901");
            let ok = out.contains("EchoPool")
                && out.contains("{192.0.2.2} 7777/SCTP")
                && out.contains("{192.0.2.3} 7777/SCTP");
            (ok, out)
        },
    );

    // rsplib's pool user resolves through our registrar and is echoed by a PE.
    let seen = rspterminal(c, &net.names[3], "hello-from-rsplib");
    assert!(
        seen.contains("from PE") && seen.contains("hello-from-rsplib"),
        "rspterminal echoed through our registrar: {seen:?}"
    );

    // A PE killed without a word: our keep-alives (1 s, 1 s to answer) remove it.
    let killed = Instant::now();
    if let Some(mut k) = pe1.take() {
        // `ip netns exec` runs the program in its own process (no fork): SIGKILL reaches it.
        let _ = k.0.kill();
        let _ = k.0.wait();
        std::mem::forget(k);
    }
    wait_until(
        "the killed PE removed, the other kept",
        Duration::from_secs(10),
        || {
            let (pes, out) = sctp_pes(reg, "192.0.2.1:3863", "EchoPool");
            let ok = pes.len() == 1 && pes[0].contains("192.0.2.3:7777");
            (ok, out)
        },
    );
    eprintln!("killed PE removed after {:?}", killed.elapsed());
    let log = std::fs::read_to_string(logs.join("registrar.log")).unwrap();
    assert!(
        log.contains(&format!(
            "ASAP over SCTP on {}://192.0.2.1:3863",
            c.scheme()
        )),
        "the registrar says where it listens: {log}"
    );
    if matches!(c, Carrier::Raw) {
        // Chosen at run time: this kernel has no SCTP, so ours runs on a raw socket.
        assert!(
            log.contains("this kernel has no SCTP"),
            "the registrar says which SCTP carries sctp://: {log}"
        );
    }
    assert_clean(&capture.decode(), false, &["192.0.2.1"]);
    remove_logs(&logs);
    drop(net);
}

fn our_pool_elements_at_rsplibs_registrar(c: Carrier) {
    if !runnable(c) {
        return;
    }
    // h0: rsplib's registrar; h1, h2: our PEs; h3: pool users, ours and rsplib's, one at a
    // time (each binds UDP 9899 in its namespace).
    let (net, logs, capture) = setup(4, &format!("{}-b", c.build()));
    let registrar_at = format!("{}://192.0.2.1:3863", c.scheme());
    let _registrar = rsplib(
        c,
        &net.names[0],
        "rspregistrar",
        &[
            "-asap=192.0.2.1:3863",
            "-enrp=192.0.2.1:9901",
            "-disable-ipv6",
        ],
        &logs.join("registrar.log"),
    );
    let pe = |i: usize| {
        let listen = format!("{}://{}:7777", c.scheme(), Net::addr(i));
        Kill(
            Command::new("ip")
                .args(["netns", "exec", &net.names[i], BIN, "example", "echo"])
                .args(["--listen", &listen, "--pool", "EchoPool"])
                .args(["--registrar", &registrar_at])
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(logs.join(format!("pe{i}.log"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let mut pe1 = Some(pe(1));
    let _pe2 = pe(2);
    let pu = &net.names[3];

    // rsplib's hsdump asks its registrar (over ENRP) for the handlespace.
    let hsdump = || hsdump(c, pu, "192.0.2.1:9901");
    wait_until(
        "both our PEs listed by rsplib's hsdump",
        Duration::from_secs(30),
        || {
            let out = hsdump();
            let ok = out.contains("EchoPool")
                && out.contains("{192.0.2.2} 7777/SCTP")
                && out.contains("{192.0.2.3} 7777/SCTP");
            (ok, out)
        },
    );

    // Our pool user resolves at rsplib's registrar over SCTP.
    let (pes, out) = sctp_pes(pu, &registrar_at, "EchoPool");
    assert!(
        pes.len() == 2
            && pes.iter().any(|l| l.contains("192.0.2.2:7777"))
            && pes.iter().any(|l| l.contains("192.0.2.3:7777")),
        "`rserpool resolve` over SCTP at rspregistrar lists both: {out}"
    );

    // rsplib's pool user is echoed by our PEs.
    let seen = rspterminal(c, pu, "hello-from-rserpool");
    assert!(
        seen.contains("from PE") && seen.contains("hello-from-rserpool"),
        "rspterminal echoed by an rserpool PE: {seen:?}"
    );

    // A PE stopped (SIGTERM) deregisters: rsplib's registrar drops it at once.
    if let Some(k) = pe1.take() {
        let pid = rustix::process::Pid::from_child(&k.0);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let mut k = k;
        let _ = k.0.wait();
    }
    wait_until(
        "the stopped PE gone from rsplib's registrar, the other kept",
        Duration::from_secs(10),
        || {
            let out = hsdump();
            let ok =
                !out.contains("{192.0.2.2} 7777/SCTP") && out.contains("{192.0.2.3} 7777/SCTP");
            (ok, out)
        },
    );
    let log = std::fs::read_to_string(logs.join("pe1.log")).unwrap();
    assert!(log.contains("deregistered"), "PE 1 deregistered: {log}");
    assert_clean(
        &capture.decode(),
        true,
        &["192.0.2.2", "192.0.2.3", "192.0.2.4"],
    );
    remove_logs(&logs);
    drop(net);
}

both_carriers!(
    our_registrar_and_rsplibs_form_one_enrp_cluster_over_sctp_in_udp,
    our_registrar_and_rsplibs_form_one_enrp_cluster_over_sctp_on_raw_ip,
    one_enrp_cluster
);

/// `rserpool registrar` and `rspregistrar` peers over ENRP on SCTP: an rsplib PE registered at
/// each, both resolvable at both (`rserpool resolve` at ours, `hsdump` at rsplib's). Then
/// rsplib's registrar is killed: ours takes its PE over (the PE adopts it as its home) and
/// keeps it.
fn one_enrp_cluster(c: Carrier) {
    if !runnable(c) {
        return;
    }
    // h0: our registrar; h1: rsplib's; h2, h3: rsplib PEs, one at each; h4: hsdump.
    let (net, logs, capture) = setup(5, &format!("{}-c", c.build()));
    let s = c.scheme();
    let _ours = our_registrar(&net.names[0], s, 0, Some(1), &logs.join("registrar.log"));
    let mut theirs = rsplib(
        c,
        &net.names[1],
        "rspregistrar",
        &[
            "-asap=192.0.2.2:3863",
            "-enrp=192.0.2.2:9901",
            "-peer=192.0.2.1:9901",
            "-disable-ipv6",
            // No SERVER_ANNOUNCE: each PE stays with the registrar it is given.
            "-asapannounce=off",
        ],
        &logs.join("rspregistrar.log"),
    );
    let pe = |i: usize, registrar: &str| {
        rsplib(
            c,
            &net.names[i],
            "rspserver",
            &[
                "-echo",
                "-poolhandle=EchoPool",
                &format!("-registrar={registrar}"),
                "-asapannounce=off",
                &format!("-local={}:7777", Net::addr(i)),
            ],
            &logs.join(format!("pe{i}.log")),
        )
    };
    // 192.0.2.3 registers at rsplib's registrar, 192.0.2.4 at ours.
    let _pe_theirs = pe(2, "192.0.2.2:3863");
    let _pe_ours = pe(3, "192.0.2.1:3863");
    wait_until(
        "both PEs resolvable at our registrar",
        Duration::from_secs(30),
        || {
            let (pes, out) = sctp_pes(&net.names[0], "192.0.2.1:3863", "EchoPool");
            let both = pes.iter().any(|l| l.contains("192.0.2.3:7777"))
                && pes.iter().any(|l| l.contains("192.0.2.4:7777"));
            (both, out)
        },
    );
    wait_until(
        "both PEs in rsplib's registrar's handlespace",
        Duration::from_secs(30),
        || {
            let out = hsdump(c, &net.names[4], "192.0.2.2:9901");
            let ok = out.contains("{192.0.2.3} 7777/SCTP") && out.contains("{192.0.2.4} 7777/SCTP");
            (ok, out)
        },
    );
    let log = std::fs::read_to_string(logs.join("rspregistrar.log")).unwrap_or_default();
    assert!(
        !log.contains("rejecting request") && !log.contains("no usable ENRP endpoint"),
        "rsplib's registrar took our registrar as a peer: {log}"
    );

    // rsplib's registrar dies: ours takes over its PE, which adopts it.
    let home_of = |ip: &str| {
        let (pes, _) = sctp_pes(&net.names[0], "192.0.2.1:3863", "EchoPool");
        pes.iter()
            .find(|l| l.contains(ip))
            .and_then(|l| l.split_whitespace().last().map(str::to_string))
    };
    let log = std::fs::read_to_string(logs.join("registrar.log")).unwrap();
    let ours = log
        .split("registrar ")
        .find_map(|t| t.split_once(" listening"))
        .map(|(id, _)| id.trim().to_string())
        .expect("our registrar's ID in its log");
    assert_eq!(
        home_of("192.0.2.4:7777").as_deref(),
        Some(ours.as_str()),
        "the PE registered at ours has ours as its home"
    );
    let _ = theirs.0.kill();
    let _ = theirs.0.wait();
    wait_until(
        "rsplib's PE taken over by our registrar",
        Duration::from_secs(20),
        || {
            let home = home_of("192.0.2.3:7777");
            let pe = std::fs::read_to_string(logs.join("pe2.log")).unwrap_or_default();
            let adopted = pe.contains(&format!("Home registrar is ${}", &ours[2..]));
            (
                home.as_deref() == Some(ours.as_str()) && adopted,
                format!("home {home:?}, ours {ours}; PE log:\n{pe}"),
            )
        },
    );
    // It stays: its keep-alives to the new home are answered.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(home_of("192.0.2.3:7777").as_deref(), Some(ours.as_str()));
    assert_clean(&capture.decode(), true, &["192.0.2.1"]);
    remove_logs(&logs);
    drop(net);
}

/// What rsplib's registrar cannot show (alone with a dead peer it never completes a takeover:
/// it waits for acknowledgements from no one until the takeover expires): a PE of rserpool's
/// library registered over SCTP taken over by a registrar whose peer died. Two rserpool
/// registrars peered over SCTP in UDP, `example echo` over SCTP registered at the first; the
/// first is killed, the second reaches the PE over SCTP at its association's port and the PE
/// adopts it.
#[test]
fn our_sctp_pool_element_is_taken_over_over_sctp() {
    if !rustix::process::geteuid().is_root() {
        rserpool_ksplice::testbed::skip("the SCTP takeover test needs root (network namespaces)");
        return;
    }
    // h0, h1: registrars; h2: the PE.
    let net = Net::new(3);
    let logs = std::env::temp_dir().join(format!("sctp-takeover-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let registrar = |i: usize, peer: usize| {
        let log = logs.join(format!("registrar{i}.log"));
        our_registrar(&net.names[i], "sctp+udp", i, Some(peer), &log)
    };
    let mut first = registrar(0, 1);
    let _second = registrar(1, 0);
    let _pe = Kill(
        Command::new("ip")
            .args(["netns", "exec", &net.names[2], BIN, "example", "echo"])
            .args([
                "--listen",
                "sctp+udp://192.0.2.3:7777",
                "--pool",
                "EchoPool",
            ])
            .args(["--registrar", "sctp+udp://192.0.2.1:3863"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(logs.join("pe.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let home_at_second = || {
        let (pes, out) = sctp_pes(&net.names[1], "192.0.2.2:3863", "EchoPool");
        let home = pes
            .iter()
            .find(|l| l.contains("192.0.2.3:7777"))
            .and_then(|l| l.split_whitespace().last().map(str::to_string));
        (home, out)
    };
    let id_of = |i: usize| {
        let log = std::fs::read_to_string(logs.join(format!("registrar{i}.log"))).unwrap();
        log.split("registrar ")
            .find_map(|t| t.split_once(" listening"))
            .map(|(id, _)| id.trim().to_string())
    };
    wait_until(
        "the PE known at the second registrar, home the first",
        Duration::from_secs(20),
        || {
            let (home, out) = home_at_second();
            (home.is_some() && home == id_of(0), out)
        },
    );
    let _ = first.0.kill();
    let _ = first.0.wait();
    let second = id_of(1).unwrap();
    wait_until(
        "the PE taken over by the second registrar and adopting it",
        Duration::from_secs(20),
        || {
            let (home, out) = home_at_second();
            let pe = std::fs::read_to_string(logs.join("pe.log")).unwrap_or_default();
            let adopted = pe.contains(&format!("taken over by registrar {second}"));
            (
                home.as_deref() == Some(second.as_str()) && adopted,
                format!("{out}\nPE log:\n{pe}"),
            )
        },
    );
    remove_logs(&logs);
    drop(net);
}
