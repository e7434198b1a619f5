//! TLS with mutual authentication (RFC 5355) between real processes on loopback: a cluster of
//! two registrars over ENRP-over-TLS, a PE and a pool user with certificates from the CA made
//! by `rserpool cert`; then everything that must be refused (a PE and a registrar with a
//! foreign CA's certificate, a PE over TLS without a certificate, a plaintext client on the
//! TLS port), each with a clear log line, while the good PE stays registered and resolvable.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, Logged, free_port, metric, scrape, wait_for};
use rserpool_wire::{AsapMessage, CauseCode, Message, PoolHandle};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// `rserpool cert --dir DIR NAMES…`: a CA (made once) and a certificate per name; the
/// names that begin with `reg` are registrars' (`--registrar NAME`).
fn certs(dir: &Path, names: &[&str]) {
    let out = Command::new(BIN)
        .args(["cert", "--dir", dir.to_str().unwrap()])
        .args(names.iter().flat_map(|n| {
            if n.starts_with("reg") {
                vec!["--registrar", n]
            } else {
                vec![*n]
            }
        }))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The TLS flags of `name`'s identity in `dir`.
fn tls(dir: &Path, name: &str) -> Vec<String> {
    tls_trusting(dir, name, dir)
}

/// The TLS flags of `name`'s identity in `dir`, trusting the CA of `ca_dir`.
fn tls_trusting(dir: &Path, name: &str, ca_dir: &Path) -> Vec<String> {
    let f = |d: &Path, x: &str| d.join(x).to_str().unwrap().to_owned();
    vec![
        "--tls-cert".into(),
        f(dir, &format!("{name}.pem")),
        "--tls-key".into(),
        f(dir, &format!("{name}.key")),
        "--tls-ca".into(),
        f(ca_dir, "ca.pem"),
    ]
}

struct Reg {
    asap: SocketAddr,
    status: SocketAddr,
    enrp: SocketAddr,
    proc: Logged,
}

fn registrar(name: &str, dir: &Path, peers: &[SocketAddr]) -> Reg {
    registrar_with(name, tls(dir, name), peers)
}

fn registrar_with(name: &str, tls_args: Vec<String>, peers: &[SocketAddr]) -> Reg {
    let (asap, status, enrp) = (addr(), addr(), addr());
    let mut args: Vec<String> = ["registrar", "--asap", &asap.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend([
        "--status".into(),
        status.to_string(),
        "--enrp".into(),
        enrp.to_string(),
    ]);
    args.extend(["--keep-alive-interval-ms".into(), "500".into()]);
    for p in peers {
        args.extend(["--peer".into(), p.to_string()]);
    }
    args.extend(tls_args);
    Reg {
        asap,
        status,
        enrp,
        proc: Logged::spawn(name, &args, "info"),
    }
}

fn example_pe(name: &str, reg: SocketAddr, id: u32, tls_args: Vec<String>) -> Logged {
    let mut args: Vec<String> = [
        "example",
        "echo",
        "--pool",
        "Secure",
        "--id",
        &id.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--listen".into(), addr().to_string()]);
    args.extend(["--registrar".into(), reg.to_string()]);
    args.extend(tls_args);
    Logged::spawn(name, &args, "info")
}

/// The PEs of pool Secure that `reg`'s status shows.
async fn pes(status: SocketAddr) -> Vec<u32> {
    common::registrar_status(status)
        .await
        .map(|s| {
            s.pools
                .iter()
                .filter(|p| p.handle == "Secure")
                .flat_map(|p| p.pes.iter().map(|pe| pe.id))
                .collect()
        })
        .unwrap_or_default()
}

fn resolve(reg: SocketAddr, tls_args: &[String]) -> std::process::Output {
    Command::new(BIN)
        .args(["resolve", "Secure", "--registrar", &reg.to_string()])
        .args(tls_args)
        .output()
        .unwrap()
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rserpool-tls-{tag}-{}", free_port()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_the_ca_s_own_and_refuses_everyone_else() {
    let dir = tempdir("ca");
    let foreign = tempdir("foreign");
    certs(&dir, &["registrar1", "registrar2", "pe", "user"]);
    certs(&foreign, &["registrar3", "pe"]);

    // A cluster of two over ENRP with TLS; a PE registers at the first, the second has it.
    let r1 = registrar("registrar1", &dir, &[]);
    let r2 = registrar("registrar2", &dir, &[r1.enrp]);
    let _pe = example_pe("pe", r1.asap, 0x51, tls(&dir, "pe"));
    wait_for(
        Duration::from_secs(15),
        "the PE on both registrars",
        || async { pes(r1.status).await == [0x51] && pes(r2.status).await == [0x51] },
    )
    .await;
    let out = resolve(r2.asap, &tls(&dir, "user"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("0x00000051"));

    // A PE with a foreign CA's certificate never registers (it trusts the registrar; the
    // registrar does not trust it).
    let _bad_pe = example_pe(
        "foreign-pe",
        r1.asap,
        0x66,
        tls_trusting(&foreign, "pe", &dir),
    );
    // Nor can a registrar with a foreign certificate join the cluster.
    let r3 = registrar_with(
        "registrar3",
        tls_trusting(&foreign, "registrar3", &dir),
        &[r1.enrp],
    );
    wait_for(
        Duration::from_secs(10),
        "both handshakes refused",
        || async {
            let refused = |what: &str| {
                !r1.proc
                    .lines_with(&format!(
                        "{what} TLS handshake refused: certificate refused"
                    ))
                    .is_empty()
            };
            refused("ASAP") && refused("ENRP")
        },
    )
    .await;
    // The PEs refused say why they cannot register, with a hint: the foreign one and one
    // without TLS at all (both said nothing before, retrying silently).
    let plain_pe = example_pe("plain-pe", r1.asap, 0x67, Vec::new());
    wait_for(
        Duration::from_secs(10),
        "the refused PEs say so",
        || async {
            !_bad_pe
                .lines_with("does it trust this PE's certificate")
                .is_empty()
                && !plain_pe
                    .lines_with("one that runs TLS closes a PE without it")
                    .is_empty()
        },
    )
    .await;

    // A client over TLS without a certificate may resolve but not register: cause 0xa.
    let client = {
        let mut roots = rserpool_tls::rustls::RootCertStore::empty();
        for c in rserpool_tls::load_certs(&dir.join("ca.pem")).unwrap() {
            roots.add(c).unwrap();
        }
        rserpool_tls::rustls::ClientConfig::builder_with_provider(rserpool_tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth()
    };
    let tcp = tokio::net::TcpStream::connect(r1.asap).await.unwrap();
    let mut s = rserpool_tls::tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect(rserpool_tls::Tls::server_name(r1.asap.ip()), tcp)
        .await
        .unwrap();
    let pe = rserpool_wire::PoolElement {
        id: 0x77,
        home_registrar: 0,
        registration_life: 30,
        user_transport: rserpool_wire::UserTransport::Address(
            rserpool_wire::TransportAddress::tcp(addr()),
        ),
        policy: rserpool_wire::Policy::RoundRobin,
        asap_transport: None,
    };
    let mut buf = Vec::new();
    AsapMessage::Registration {
        pool_handle: PoolHandle::from("Secure"),
        pool_element: pe,
    }
    .encode(&mut buf)
    .unwrap();
    s.write_all(&buf).await.unwrap();
    let mut framer = rserpool_wire::Framer::new(65536);
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(m) = framer.next_message().unwrap() {
                return AsapMessage::decode(&m).unwrap();
            }
            assert!(s.read_buf(framer.buffer_mut()).await.unwrap() > 0, "closed");
        }
    })
    .await
    .unwrap();
    let AsapMessage::RegistrationResponse { reject, error, .. } = answer else {
        panic!("{answer:?}");
    };
    assert!(reject);
    assert_eq!(error.unwrap().causes[0].code, CauseCode::REJECTED_SECURITY);

    // A plaintext client on the TLS port is closed, with a log line that says so.
    let mut plain = tokio::net::TcpStream::connect(r1.asap).await.unwrap();
    plain.write_all(&buf).await.unwrap();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "the plaintext client was not closed");
    wait_for(Duration::from_secs(5), "the plaintext log line", || async {
        !r1.proc
            .lines_with("a plaintext client on a TLS port?")
            .is_empty()
    })
    .await;

    // Nobody else was disturbed: the good PE is still the only one, on both registrars; the
    // foreign registrar has none of it; the refusals are counted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(pes(r1.status).await, [0x51]);
    assert_eq!(pes(r2.status).await, [0x51]);
    assert!(pes(r3.status).await.is_empty());
    let st = common::registrar_status(r1.status).await.unwrap();
    assert!(
        st.peers
            .iter()
            .all(|p| p.address != r3.enrp.to_string() || p.state != "alive")
    );
    let m = scrape(r1.status).await;
    assert!(metric(&m, "rserpool_registrar_tls_refused_total", &[]) >= 3.0);
    assert!(
        metric(
            &m,
            "rserpool_registrar_errors_sent_total",
            &[("cause", "0xa")]
        ) >= 1.0
    );
    let out = resolve(r1.asap, &tls(&dir, "user"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(foreign);
}

/// A proxy config in `dir`/proxy.toml: the registrar at `reg` over TLS (the proxy's identity
/// in `dir`), then `rest` (top-level keys first, then tables).
fn proxy_config(dir: &Path, reg: SocketAddr, rest: &str) -> PathBuf {
    let d = dir.display();
    let (keys, tables) = rest.split_at(rest.find("\n[").map_or(rest.len(), |i| i + 1));
    let conf = format!(
        r#"registrars = ["{reg}"]
refresh-ms = 200
{keys}
[registrar-tls]
cert = "{d}/proxy.pem"
key = "{d}/proxy.key"
ca = "{d}/ca.pem"

{tables}"#
    );
    let path = dir.join("proxy.toml");
    std::fs::write(&path, conf).unwrap();
    path
}

/// An HTTPS connection to `front` asking for `name` (SNI), trusting the CA of `dir`.
async fn https_connect(
    front: SocketAddr,
    name: &str,
    dir: &Path,
) -> std::io::Result<rserpool_tls::tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rserpool_tls::rustls::RootCertStore::empty();
    for c in rserpool_tls::load_certs(&dir.join("ca.pem")).unwrap() {
        roots.add(c).unwrap();
    }
    let cfg = rserpool_tls::rustls::ClientConfig::builder_with_provider(rserpool_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(front).await?;
    let server = rserpool_tls::rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
    rserpool_tls::tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(server, tcp)
        .await
}

/// One response read off `s` (its head and a Content-Length body), as text.
async fn response<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut byte))
            .await
            .expect("no response in time")
            .unwrap();
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&got));
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).into_owned();
    let len = common::content_length(&head);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    head + &String::from_utf8_lossy(&body)
}

/// An HTTPS request to `front` asking for `name` (SNI), trusting the CA of `dir`: the answer.
async fn https_get(front: SocketAddr, name: &str, dir: &Path) -> std::io::Result<String> {
    let mut s = https_connect(front, name, dir).await?;
    let req = format!("GET /hello HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_terminates_https_by_sni_and_speaks_tls_to_the_registrar() {
    let dir = tempdir("https");
    certs(&dir, &["registrar1", "pe", "proxy", "a.test", "b.test"]);
    let r1 = registrar("registrar1", &dir, &[]);
    let mut pe_args: Vec<String> = ["example", "http", "--pool", "Web", "--id", "9"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    pe_args.extend(["--listen".into(), addr().to_string()]);
    pe_args.extend(["--registrar".into(), r1.asap.to_string()]);
    pe_args.extend(tls(&dir, "pe"));
    let _pe = Logged::spawn("pe", &pe_args, "warn");
    let (front, status) = (addr(), addr());
    let d = dir.display();
    let conf_path = proxy_config(
        &dir,
        r1.asap,
        &format!(
            r#"status = "{status}"

[[listener]]
listen = "{front}"
mode = "http"
pool = "Web"

[[listener.certificate]]
cert = "{d}/a.test.pem"
key = "{d}/a.test.key"
names = ["a.test"]

[[listener.certificate]]
cert = "{d}/b.test.pem"
key = "{d}/b.test.key"
names = ["b.test"]
"#
        ),
    );
    let check = Command::new(BIN)
        .args(["check-config", conf_path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let proxy = Logged::spawn(
        "proxy",
        &[
            "proxy".into(),
            "--config".into(),
            conf_path.to_str().unwrap().into(),
        ],
        "info",
    );
    wait_for(Duration::from_secs(15), "the proxy has the PE", || async {
        https_get(front, "a.test", &dir)
            .await
            .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    // Each name gets its own certificate: the handshake checks the name against it.
    for name in ["a.test", "b.test"] {
        let r = https_get(front, name, &dir).await.unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{name}: {r}");
    }
    // A kept-alive HTTPS connection: served again after a pause (its wait for the next
    // request holds no read buffer, the TLS records read into rustls's own), for a pipelined
    // pair, and for a request whose records come in two pieces.
    let mut s = https_connect(front, "a.test", &dir).await.unwrap();
    let get = b"GET /hello HTTP/1.1\r\nHost: a.test\r\n\r\n";
    s.write_all(get).await.unwrap();
    assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    s.write_all(get).await.unwrap();
    assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    s.write_all(&[&get[..], &get[..]].concat()).await.unwrap();
    assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    // More pipelined requests than one read of the proxy takes (16 KiB): the rest waits as
    // plaintext inside rustls, with nothing more to come from the socket.
    s.write_all(&get.repeat(500)).await.unwrap();
    for _ in 0..500 {
        assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    }
    s.write_all(&get[..10]).await.unwrap();
    s.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(&get[10..]).await.unwrap();
    assert!(response(&mut s).await.starts_with("HTTP/1.1 200"));
    // The last response of a `Connection: close` client, larger than the socket buffers,
    // with more bytes from the client after its request: the proxy reads them off before it
    // closes (a close with them unread would reset the connection and drop what is still in
    // its send buffer).
    let n = 20_000_000usize;
    for _ in 0..3 {
        let mut s = https_connect(front, "a.test", &dir).await.unwrap();
        let req = format!("GET /bytes/{n} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(get).await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut out = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
            .await
            .expect("the download ends");
        assert!(r.is_ok(), "{r:?} after {} bytes", out.len());
        let head_len = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert_eq!(out.len() - head_len, n, "the whole body arrived");
    }
    // A name without a certificate of its own gets the first one, which is not valid for it.
    assert!(https_get(front, "c.test", &dir).await.is_err());
    // Plain HTTP on the HTTPS port is closed; the proxy serves on.
    let mut plain = tokio::net::TcpStream::connect(front).await.unwrap();
    plain
        .write_all(b"GET /hello HTTP/1.1\r\nHost: a.test\r\n\r\n")
        .await
        .unwrap();
    let mut sink = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "not closed");
    assert!(!String::from_utf8_lossy(&sink).contains("200 OK"));
    assert!(
        https_get(front, "b.test", &dir)
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200")
    );
    let m = scrape(status).await;
    assert!(metric(&m, "rserpool_proxy_requests_total", &[("pool", "Web")]) >= 3.0);
    // The plaintext client and the name without a certificate of its own.
    let failures = metric(&m, "rserpool_proxy_tls_handshake_failures_total", &[]);
    assert!(failures >= 2.0, "{failures}");
    assert!(
        proxy
            .lines_with("listener on")
            .iter()
            .any(|l| l.contains("(TLS)"))
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A PE that speaks only HTTPS: a certificate for 127.0.0.1 from the CA of `dir`; answers
/// every request with `hello`. Returns its address.
async fn https_pe(dir: &Path, name: &str) -> SocketAddr {
    let tls = rserpool_tls::Tls::load(&rserpool_tls::TlsFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
        ca: dir.join("ca.pem"),
    })
    .unwrap();
    let acceptor = rserpool_tls::tokio_rustls::TlsAcceptor::from(tls.server(false));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(s).await else {
                    return;
                };
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let answer = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
                        if s.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_speaks_tls_to_the_pes_of_a_pool_that_asks_for_it() {
    let dir = tempdir("pe-tls");
    certs(&dir, &["registrar1", "pe", "proxy"]);
    let r1 = registrar("registrar1", &dir, &[]);
    let pe_at = https_pe(&dir, "pe").await;
    let mut cfg =
        rserpool_asap::PoolElementConfig::new("Secure", pe_at, rserpool_wire::Policy::RoundRobin);
    cfg.registrars = vec![r1.asap];
    cfg.tls = Some(Arc::new(
        rserpool_tls::Tls::load(&rserpool_tls::TlsFiles {
            cert: dir.join("pe.pem"),
            key: dir.join("pe.key"),
            ca: dir.join("ca.pem"),
        })
        .unwrap(),
    ));
    let pe = rserpool_asap::PoolElement::start(cfg).unwrap();
    pe.wait_registered(Duration::from_secs(10)).await.unwrap();
    let front = addr();
    let d = dir.display();
    let conf_path = proxy_config(
        &dir,
        r1.asap,
        &format!(
            r#"[[listener]]
listen = "{front}"
mode = "http"
pool = "Secure"

[pool.Secure.tls]
ca = "{d}/ca.pem"
cert = "{d}/proxy.pem"
key = "{d}/proxy.key"
"#
        ),
    );
    let _proxy = Logged::spawn(
        "proxy",
        &[
            "proxy".into(),
            "--config".into(),
            conf_path.to_str().unwrap().into(),
        ],
        "info",
    );
    let get = || async {
        let mut c = rserpool_proxy::http::client::Client::connect(front)
            .await
            .ok()?;
        let r = c.get("/x").await.ok()?;
        Some((r.code, String::from_utf8_lossy(&r.body).into_owned()))
    };
    wait_for(
        Duration::from_secs(15),
        "an answer through TLS to the PE",
        || async { get().await.is_some_and(|(code, _)| code == 200) },
    )
    .await;
    for _ in 0..5 {
        assert_eq!(get().await, Some((200, "hello".into())));
    }
    // A TCP listener cannot ask for TLS to its PEs: the config says why.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        format!(
            "[[listener]]\nlisten = \"{}\"\nmode = \"tcp\"\npool = \"Secure\"\n[pool.Secure.tls]\nca = \"{d}/ca.pem\"\n",
            addr()
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--kind", "proxy", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("TLS to PEs is for HTTP listeners"));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_takes_over_a_pe_over_tls() {
    let dir = tempdir("takeover");
    certs(&dir, &["registrar1", "registrar2", "pe"]);
    // Short ENRP timers: a silent peer is taken over about a second after it dies.
    let fast = |name: &str| {
        let mut a = tls(&dir, name);
        for (k, v) in [
            ("--peer-heartbeat-ms", "200"),
            ("--max-time-last-heard-ms", "500"),
            ("--max-time-no-response-ms", "500"),
        ] {
            a.extend([k.to_string(), v.to_string()]);
        }
        a
    };
    let mut r1 = registrar_with("registrar1", fast("registrar1"), &[]);
    let r2 = registrar_with("registrar2", fast("registrar2"), &[r1.enrp]);
    let pe = example_pe("pe", r1.asap, 0x42, tls(&dir, "pe"));
    let id = |status| async move {
        for _ in 0..100 {
            if let Some(s) = common::registrar_status(status).await {
                return s.server_id;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no status at {status}");
    };
    let (id1, id2) = (Some(id(r1.status).await), Some(id(r2.status).await));
    let home_at = |status: SocketAddr| async move {
        common::registrar_status(status).await.and_then(|s| {
            s.pools
                .iter()
                .flat_map(|p| &p.pes)
                .find(|pe| pe.id == 0x42)
                .map(|pe| pe.home_registrar)
        })
    };
    wait_for(
        Duration::from_secs(15),
        "the PE homed at registrar 1, on both",
        || async { home_at(r1.status).await == id1 && home_at(r2.status).await == id1 },
    )
    .await;
    println!(
        "registrar 1 {id1:x?}, registrar 2 {id2:x?}: the PE is homed at {:x?}",
        home_at(r2.status).await
    );
    // A forged takeover with a certificate of the CA that is not a registrar's (the PE's own
    // kind): the PE closes it before reading a word, says why, and stays with its home.
    // Before, any certificate of the CA was taken for a registrar's.
    let takeover_at: SocketAddr = common::registrar_status(r1.status)
        .await
        .unwrap()
        .pools
        .iter()
        .flat_map(|p| &p.pes)
        .find(|pe| pe.id == 0x42)
        .and_then(|pe| pe.asap_transport.clone())
        .and_then(|t| t.strip_prefix("tcp ").map(str::to_owned))
        .and_then(|a| a.parse().ok())
        .expect("the PE's takeover address");
    let forger = rserpool_tls::Tls::load(&rserpool_tls::TlsFiles {
        cert: dir.join("pe.pem"),
        key: dir.join("pe.key"),
        ca: dir.join("ca.pem"),
    })
    .unwrap();
    let s = tokio::net::TcpStream::connect(takeover_at).await.unwrap();
    let mut s = forger
        .connect_stream(takeover_at.ip(), s)
        .await
        .expect("the PE's certificate checks out");
    let claim = AsapMessage::EndpointKeepAlive {
        home: true,
        server_id: 0xdead_beef,
        pool_handle: PoolHandle::from("Secure"),
        pe_id: Some(0x42),
    };
    let _ = s.write_all(&claim.to_bytes().unwrap()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
    assert!(
        answer.is_empty(),
        "the PE answered a forged takeover: {answer:?}"
    );
    wait_for(Duration::from_secs(5), "the PE says why", || async {
        !pe.lines_with("its certificate is not a registrar's")
            .is_empty()
    })
    .await;
    // `rserpool attack takeover` with the TLS options makes the same claim over TLS (it
    // spoke plaintext to the takeover port before, which proved nothing): refused.
    let mut attack: Vec<String> = [
        "attack",
        "takeover",
        "--pool",
        "Secure",
        "--hold-ms",
        "1000",
        "--registrar",
        &r1.asap.to_string(),
    ]
    .map(String::from)
    .to_vec();
    attack.extend(tls(&dir, "pe"));
    let out = Command::new(BIN).args(&attack).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("Refused"),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(home_at(r1.status).await, id1, "the PE left its home");
    assert!(
        pe.lines_with("taken over by registrar 0xdeadbeef")
            .is_empty()
    );
    common::signal(&r1.proc.proc, rustix::process::Signal::KILL);
    let _ = r1.proc.proc.wait();
    // Registrar 2 takes the PE over: it connects to the PE's takeover port over TLS (each
    // checks the other's certificate), and the PE adopts it as its home.
    let took = wait_for(
        Duration::from_secs(20),
        "the PE homed at registrar 2",
        || async { home_at(r2.status).await == id2 },
    )
    .await;
    let adopted = format!("taken over by registrar {:#010x}", id2.unwrap_or_default());
    let took = took
        + wait_for(
            Duration::from_secs(10),
            "the PE adopts registrar 2",
            || async { !pe.lines_with(&adopted).is_empty() },
        )
        .await;
    println!("taken over over TLS in {took:?}");
    assert!(r2.proc.lines_with("TLS handshake refused").is_empty());
    assert!(pe.lines_with("TLS handshake").is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// `rserpool drain tls://ADDR` from another host: a PE with `--control-tls` drains and undrains
/// for a client with a certificate from its CA; one from another CA, or one without any, is
/// refused and the PE stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_drain_needs_a_certificate_from_the_ca() {
    let dir = tempdir("drain");
    let foreign = tempdir("drain-foreign");
    certs(&dir, &["reg", "pe", "operator"]);
    certs(&foreign, &["intruder"]);
    let reg = registrar("reg", &dir, &[]);
    let control = addr();
    let mut pe_args = tls(&dir, "pe");
    pe_args.extend(["--control-tls".into(), control.to_string()]);
    let _pe = example_pe("pe", reg.asap, 5, pe_args);
    let status = reg.status;
    common::wait_for(
        Duration::from_secs(10),
        "the PE registered",
        || async move { pes(status).await == vec![5] },
    )
    .await;
    let drain = |cmd: &'static str, who: Vec<String>| {
        let target = format!("tls://{control}");
        async move {
            tokio::task::spawn_blocking(move || {
                Command::new(BIN)
                    .args([cmd, &target])
                    .args(who)
                    .output()
                    .unwrap()
            })
            .await
            .unwrap()
        }
    };
    // Refused: another CA's certificate, and no certificate at all.
    let out = drain("drain", tls_trusting(&foreign, "intruder", &dir)).await;
    assert!(!out.status.success(), "an intruder drained the PE");
    let out = drain("drain", Vec::new()).await;
    assert!(!out.status.success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pes(status).await, vec![5], "the PE stays");
    // The CA's own operator.
    let out = drain("drain", tls(&dir, "operator")).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::wait_for(Duration::from_secs(5), "the PE drained", || async move {
        pes(status).await.is_empty()
    })
    .await;
    let out = drain("undrain", tls(&dir, "operator")).await;
    assert!(out.status.success());
    common::wait_for(Duration::from_secs(5), "the PE back", || async move {
        pes(status).await == vec![5]
    })
    .await;
}
