//! Test support, shared by this crate's tests and the proxy's: a client | proxy | server
//! topology of network namespaces joined by veth pairs, threads inside a namespace, and a
//! byte-exact exchange. Not for production use.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::missing_panics_doc)]

use crate::{Datapath, Splice, clamp_mss, hand_over, ifindex, pending, save_syn, unavailable};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Says why a test cannot run and whether to skip it: never under `CI`, where it fails.
pub fn skip(why: &str) -> bool {
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("SKIPPED: {why}");
    true
}

/// A bpffs of the test's own, mounted outside /sys: `ip netns exec` gives each process a /sys
/// of its own, where a bpffs mounted by one proxy is not seen by the next, so a process that
/// takes over from another (an upgrade) would not find the pinned maps. (A service manager's
/// /sys/fs/bpf is shared by all its processes.) Unmounted, with its pins, when dropped.
pub struct SharedBpffs(pub PathBuf);

impl SharedBpffs {
    /// A bpffs at /run/`name`-PID. `None` (the test is skipped) without root, except under
    /// `CI`, where that fails.
    pub fn mount(name: &str) -> Option<SharedBpffs> {
        let dir = PathBuf::from(format!("/run/{name}-{}", std::process::id()));
        let ok = std::fs::create_dir_all(&dir).is_ok()
            && Command::new("mount")
                .args(["-t", "bpf", "bpf"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
        if !ok {
            skip(&format!(
                "cannot mount a bpffs at {} (needs root)",
                dir.display()
            ));
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(SharedBpffs(dir))
    }
}

impl Drop for SharedBpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Runs `ip` with `args`; panics when it fails.
pub fn ip(args: &str) {
    let ok = Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip {args}");
}

/// Namespaces (and the datapath's pinned maps) that go away with the test.
pub struct Netns(pub Vec<String>, pub PathBuf);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
        let _ = Datapath::remove_all(&[], &self.1);
    }
}

/// Runs `f` on a thread inside namespace `ns`.
pub fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap();
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&fd),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
        f()
    })
}

pub const N: usize = 8 << 20;

/// Where the tests' proxy listens (towards the client), and where their server does.
pub const FRONT: SocketAddrV4 = SocketAddrV4::new(std::net::Ipv4Addr::new(10, 77, 1, 1), 8080);
pub const SERVER: SocketAddrV4 = SocketAddrV4::new(std::net::Ipv4Addr::new(10, 77, 2, 2), 9000);

/// Sends N bytes of pattern `seed` and reads everything the other end sends, at once.
pub fn exchange(conn: TcpStream, seed: u8) -> Vec<u8> {
    exchange_n(conn, seed, N)
}

/// Sends `n` bytes of pattern `seed` and reads everything the other end sends, at once.
pub fn exchange_n(conn: TcpStream, seed: u8, n: usize) -> Vec<u8> {
    send_and_read(conn, patterned(n, seed))
}

/// Sends `buf` (then ends the sending side) and reads everything the other end sends, at
/// once.
pub fn send_and_read(mut conn: TcpStream, buf: Vec<u8>) -> Vec<u8> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut w = conn.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        w.write_all(&buf).unwrap();
        w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut got = Vec::new();
    conn.read_to_end(&mut got).unwrap();
    writer.join().unwrap();
    got
}

/// Checks transfers that ran across a proxy's kill at `killed`: at least one still ran then
/// (else the test proved nothing), and each is `len` bytes of pattern `seed`.
pub fn assert_outlived(
    done: Vec<(Vec<u8>, std::time::Instant)>,
    killed: std::time::Instant,
    len: usize,
    seed: u8,
) {
    assert!(
        done.iter().any(|(_, at)| *at > killed),
        "every transfer ended before the kill: the test proved nothing"
    );
    for (got, _) in done {
        assert_pattern(&got, len, seed, "transfer");
    }
}

/// `n` bytes of the pattern `seed` (a period of 251 bytes, copied: fast in debug builds).
pub fn patterned(n: usize, seed: u8) -> Vec<u8> {
    let period: Vec<u8> = (0..251).map(|i| pattern(i, seed)).collect();
    let mut buf = Vec::with_capacity(n + 251);
    while buf.len() < n {
        buf.extend_from_slice(&period);
    }
    buf.truncate(n);
    buf
}

/// Byte `i` of the pattern `seed`.
pub fn pattern(i: usize, seed: u8) -> u8 {
    ((i % 251) as u8).wrapping_add(seed)
}

/// Whether namespace tests can run here (root, a datapath in this build), and a tag that
/// makes this call's namespace names unique. `None`: skipped (says why; fails under `CI`).
fn namespaces_tag(what: &str, kind: char) -> Option<String> {
    let n = datapath_test(&format!("{what} needs root (network namespaces, eBPF)"))?;
    Some(format!("{}{kind}{n}", std::process::id() % 100_000))
}

/// Whether a test that loads the datapath can run here (root, a datapath in this build), and
/// a number unique in this process for the names it makes. `None`: skipped, saying why
/// (`needs_root` when not root); fails under `CI`.
pub fn datapath_test(needs_root: &str) -> Option<u32> {
    if !rustix::process::geteuid().is_root() {
        skip(needs_root);
        return None;
    }
    if let Some(why) = unavailable() {
        skip(why);
        return None;
    }
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    Some(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// client | proxy | server namespaces joined by veth pairs (c0–p0, p1–s0), with `loss_percent`
/// of TCP packets dropped on input at the client and the server. `None`: skipped.
pub fn topology(loss_percent: u32) -> Option<(Netns, String, String, String)> {
    let tag = namespaces_tag("the kernel splice test", 'x')?;
    let (c, p, s) = (
        format!("ksc{tag}"),
        format!("ksp{tag}"),
        format!("kss{tag}"),
    );
    let ns = Netns(
        vec![c.clone(), p.clone(), s.clone()],
        PathBuf::from(format!("/sys/fs/bpf/rserpool-test-{tag}")),
    );
    for n in [&c, &p, &s] {
        ip(&format!("netns add {n}"));
        ip(&format!("-n {n} link set lo up"));
    }
    ip(&format!(
        "-n {c} link add c0 type veth peer name p0 netns {p}"
    ));
    ip(&format!(
        "-n {s} link add s0 type veth peer name p1 netns {p}"
    ));
    ip(&format!("-n {c} addr add 10.77.1.2/24 dev c0"));
    ip(&format!("-n {p} addr add 10.77.1.1/24 dev p0"));
    ip(&format!("-n {p} addr add 10.77.2.1/24 dev p1"));
    ip(&format!("-n {s} addr add 10.77.2.2/24 dev s0"));
    for (n, d) in [(&c, "c0"), (&p, "p0"), (&p, "p1"), (&s, "s0")] {
        ip(&format!("-n {n} link set {d} up"));
    }
    if loss_percent > 0 {
        for n in [&c, &s] {
            let rules = format!(
                "table inet loss {{\n chain input {{\n  type filter hook input priority 0;\n  \
                 meta l4proto tcp numgen random mod 100 < {loss_percent} drop\n }}\n}}\n"
            );
            let ok = Command::new("ip")
                .args(["netns", "exec", n, "nft", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut ch| {
                    ch.stdin.take().unwrap().write_all(rules.as_bytes())?;
                    ch.wait()
                })
                .is_ok_and(|st| st.success());
            if !ok {
                skip("the loss test needs nftables (apt-get install -y nftables)");
                return None;
            }
        }
    }

    Some((ns, c, p, s))
}

/// A listener as the proxy's: it saves each connection's SYN for the hand-over.
pub fn listener(addr: SocketAddrV4) -> TcpListener {
    let l = TcpListener::bind(addr).unwrap();
    save_syn(&l).unwrap();
    l
}

/// The proxy's part in a test, as `rserpool proxy` does it: accepts one connection on `l`
/// (from [`listener`]), reads the client's `HELLO\n`, connects from `back` to `server` (the
/// server's packets watched from before the SYN, the MSS clamped to the client's, a receive
/// buffer of `rcvbuf` if given), relays the HELLO and the server's `WELCOME\n`, waits until
/// both sockets are quiet and hands the connection to `dp` on interfaces p0 and p1. Unlike
/// the proxy it relays nothing meanwhile: the test's client and server must not send more
/// until it returns.
pub fn route_and_hand_over(
    dp: &mut Datapath,
    l: &TcpListener,
    back: SocketAddrV4,
    server: SocketAddrV4,
    rcvbuf: Option<usize>,
) -> Splice {
    let (mut a, _) = l.accept().unwrap();
    let mut hello = [0u8; 6];
    a.read_exact(&mut hello).unwrap();
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_reuse_address(true).unwrap();
    sock.bind(&std::net::SocketAddr::V4(back).into()).unwrap();
    if let Some(n) = rcvbuf {
        sock.set_recv_buffer_size(n).unwrap();
    }
    clamp_mss(&sock, &a).unwrap();
    dp.watch(server, back, None).unwrap();
    sock.connect(&std::net::SocketAddr::V4(server).into())
        .unwrap();
    let mut b: TcpStream = sock.into();
    b.write_all(&hello).unwrap();
    let mut welcome = [0u8; 8];
    b.read_exact(&mut welcome).unwrap();
    a.write_all(&welcome).unwrap();
    let t0 = std::time::Instant::now();
    while pending(&a).unwrap() + pending(&b).unwrap() > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the sockets never went quiet"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (p0, p1) = (ifindex("p0").unwrap(), ifindex("p1").unwrap());
    let splice = hand_over(dp, a, b, p0, p1).map_err(|(e, _, _)| e).unwrap();
    eprintln!("handed over after {:?}: {splice:?}", t0.elapsed());
    splice
}

/// The client's part: connects to `front`, says `HELLO\n` and reads the `WELCOME\n`.
pub fn greet(front: SocketAddrV4) -> TcpStream {
    let mut conn = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
    conn.write_all(b"HELLO\n").unwrap();
    let mut welcome = [0u8; 8];
    conn.read_exact(&mut welcome).unwrap();
    assert_eq!(&welcome, b"WELCOME\n");
    conn
}

/// The server's part: reads `HELLO\n` and says `WELCOME\n`.
pub fn welcome(conn: &mut TcpStream) {
    let mut hello = [0u8; 6];
    conn.read_exact(&mut hello).unwrap();
    assert_eq!(&hello, b"HELLO\n");
    conn.write_all(b"WELCOME\n").unwrap();
}

/// Asserts that `got` is `len` bytes of pattern `seed`.
pub fn assert_pattern(got: &[u8], len: usize, seed: u8, what: &str) {
    assert_eq!(got.len(), len, "{what}: length");
    let want = patterned(len, seed);
    if got != want.as_slice() {
        let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        panic!("{what}: byte {i} differs");
    }
}

/// The proxy tier's test network (docs/TIER.md): a client, a router, proxies and servers in
/// namespaces. The router joins the client (10.88.0.2 ↔ .1), the proxies on one bridged
/// segment (10.88.1.1, proxy i at 10.88.1.{10 + i}) and the servers on another (10.88.2.1,
/// server j at 10.88.2.{10 + j}); it forwards with layer-4 ECMP hashing. Every proxy has the
/// clients' address [`TIER_VIP`] and the shared server-facing address [`TIER_SHARED`] on its
/// loopback; the routes towards them (a nexthop group of the proxies) are the distributor's
/// to make. Each namespace's interface to the router is `t0`.
pub struct TierNet {
    pub ns: Netns,
    pub client: String,
    pub router: String,
    pub proxies: Vec<String>,
    pub servers: Vec<String>,
    /// Where each proxy pins its datapath's maps (one directory per proxy, on `bpffs`, so
    /// that a proxy's successor finds them).
    pub pins: Vec<PathBuf>,
    pub bpffs: SharedBpffs,
}

pub const TIER_VIP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 88, 9, 1);
pub const TIER_SHARED: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 88, 9, 2);

impl Drop for TierNet {
    fn drop(&mut self) {
        for pin in &self.pins {
            let _ = Datapath::remove_all(&[], pin);
        }
        for j in 1..=self.servers.len() {
            let _ = Datapath::remove_all(&[], &self.split_pins(j));
        }
    }
}

impl TierNet {
    /// Proxy `i`'s (1-based) own address.
    pub fn proxy_addr(i: usize) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::new(10, 88, 1, 10 + i as u8)
    }

    /// Server `j`'s (1-based) address.
    pub fn server_addr(j: usize) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::new(10, 88, 2, 10 + j as u8)
    }

    /// The router's address on the proxies' segment (where the registrar runs).
    pub const ROUTER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 88, 1, 1);
    pub const CLIENT: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 88, 0, 2);

    /// `rserpool proxy`'s configuration for proxy `i` (1-based): a TCP listener on
    /// [`TIER_VIP`]:7000 onto pool WebPool handed to the kernel splice, member of tier
    /// ProxyTier with ports 2i000–2i999; `extra` goes into its `[kernel-splice]` section.
    pub fn proxy_config(&self, i: usize, extra: &str) -> String {
        let me = Self::proxy_addr(i);
        format!(
            "registrars = [\"{router}:3863\"]\nrefresh-ms = 200\nstatus = \"{me}:8404\"\n\
             [[listener]]\nlisten = \"{TIER_VIP}:7000\"\nmode = \"tcp\"\npool = \"WebPool\"\n\
             splice = \"kernel\"\n[kernel-splice]\ninterfaces = [\"t0\"]\npin-dir = \"{pins}\"\n\
             hold-after-ms = 50\n{extra}\n[tier]\npool = \"ProxyTier\"\nlisten = \"{me}:9950\"\n\
             server-address = \"{TIER_SHARED}\"\nports = \"{lo}-{hi}\"\n",
            router = Self::ROUTER,
            pins = self.pins[i - 1].display(),
            lo = 20_000 + 1000 * i,
            hi = 20_999 + 1000 * i,
        )
    }

    /// Where server `j`'s split splice pins its maps.
    pub fn split_pins(&self, j: usize) -> PathBuf {
        let mut p = self.ns.1.clone().into_os_string();
        p.push(format!("-s{j}"));
        p.into()
    }

    /// `rserpool split-splice`'s arguments on server `j` (1-based).
    pub fn split_splice_args(&self, j: usize) -> Vec<String> {
        let listen = format!("{}:9960", Self::server_addr(j));
        let pins = self.split_pins(j).display().to_string();
        let reg = format!("{}:3863", Self::ROUTER);
        [
            "split-splice",
            "--tier",
            "ProxyTier",
            "--listen",
            &listen,
            "--interface",
            "t0",
            "--pin-dir",
            &pins,
            "--registrar",
            &reg,
        ]
        .map(String::from)
        .to_vec()
    }

    /// The nexthop group the distributor keeps on the router.
    pub const GROUP: u32 = 100;

    /// `rserpool distributor`'s arguments on the router: the tier pool, group [`GROUP`]
    /// (`Self::GROUP`), heartbeats every `heartbeat_ms`, routes to the VIP and the shared
    /// address; with `watch`, the traffic watch on the proxies' bridge.
    pub fn distributor_args(heartbeat_ms: u64, watch: bool) -> Vec<String> {
        let reg = format!("{}:3863", Self::ROUTER);
        let watch = if watch { &["--watch", "brp"][..] } else { &[] };
        [
            "distributor".to_string(),
            "--pool".into(),
            "ProxyTier".into(),
            "--registrar".into(),
            reg,
            "--group".into(),
            Self::GROUP.to_string(),
            "--heartbeat-ms".into(),
            heartbeat_ms.to_string(),
            "--route".into(),
            format!("{TIER_VIP}/32"),
            "--route".into(),
            format!("{TIER_SHARED}/32"),
        ]
        .into_iter()
        .chain(watch.iter().map(|w| w.to_string()))
        .collect()
    }

    /// How many members nexthop group `id` of the router has (0: none, or no group yet).
    pub fn group_members(&self, id: u32) -> usize {
        group_members(&self.router, id)
    }

    /// Cuts proxy `i` (1-based) off: its interface goes down (as a dead host's would).
    pub fn cut_proxy(&self, i: usize) {
        ip(&format!("-n {} link set t0 down", self.proxies[i - 1]));
    }

    /// Cuts proxy `i` off silently, as a machine that dies with its link up: the router's
    /// bridge drops every frame to and from its port (nftables). A link that goes down has
    /// the bridge flood the frames for its MAC to the other proxies instead, which carry them
    /// at once; here only the distributor's heartbeats find it.
    pub fn silence_proxy(&self, i: usize) -> Result<(), String> {
        let port = format!("rp{i}");
        let rules = format!(
            "table bridge dead{i} {{\n \
             chain fwd_cut {{\n  type filter hook forward priority 0;\n  \
             iifname \"{port}\" drop\n  oifname \"{port}\" drop\n }}\n \
             chain in_cut {{\n  type filter hook input priority 0;\n  \
             iifname \"{port}\" drop\n }}\n \
             chain out_cut {{\n  type filter hook output priority 0;\n  \
             oifname \"{port}\" drop\n }}\n}}\n"
        );
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &self.router, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("nft (apt-get install nftables): {e}"))?;
        if let Some(mut stdin) = nft.stdin.take() {
            stdin
                .write_all(rules.as_bytes())
                .map_err(|e| format!("nft: {e}"))?;
        }
        match nft.wait() {
            Ok(st) if st.success() => Ok(()),
            _ => Err(format!("nft refused the rules that cut proxy {i} off")),
        }
    }

    /// Brings proxy `i`'s interface back.
    pub fn restore_proxy(&self, i: usize) {
        ip(&format!("-n {} link set t0 up", self.proxies[i - 1]));
        ip(&format!(
            "-n {} route add default via {}",
            self.proxies[i - 1],
            Self::ROUTER
        ));
    }
}

/// Members of nexthop group `id` in namespace `router` (0 when there is none): the distinct
/// gateways of its nexthops (the distributor gives each member more than one).
pub fn group_members(router: &str, id: u32) -> usize {
    let out = Command::new("ip")
        .args(["-n", router, "nexthop", "show"])
        .output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let after = |words: &[&str], key: &str| -> Option<String> {
        let i = words.iter().position(|w| *w == key)?;
        words.get(i + 1).map(|w| w.to_string())
    };
    let mut via = std::collections::HashMap::new();
    let mut group = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(nh) = after(&words, "id") else {
            continue;
        };
        if nh == id.to_string() {
            group = after(&words, "group")
                .map(|g| {
                    g.split('/')
                        .map(|e| e.split(',').next().unwrap_or("").to_string())
                        .collect()
                })
                .unwrap_or_default();
        } else if let Some(gw) = after(&words, "via") {
            via.insert(nh, gw);
        }
    }
    group
        .iter()
        .filter_map(|nh| via.get(nh))
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// Builds a [`TierNet`] of `proxies` proxies and `servers` servers. `None`: skipped (not root,
/// or no datapath in this build).
pub fn tier_topology(proxies: usize, servers: usize) -> Option<TierNet> {
    let tag = namespaces_tag("the proxy tier test", 'y')?;
    let client = format!("tc{tag}");
    let router = format!("tr{tag}");
    let px: Vec<String> = (1..=proxies).map(|i| format!("tp{i}{tag}")).collect();
    let sv: Vec<String> = (1..=servers).map(|j| format!("ts{j}{tag}")).collect();
    let mut all = vec![client.clone(), router.clone()];
    all.extend(px.iter().cloned());
    all.extend(sv.iter().cloned());
    let bpffs = SharedBpffs::mount(&format!("rserpool-tier-{tag}"))?;
    let pins: Vec<PathBuf> = (1..=proxies)
        .map(|i| bpffs.0.join(format!("p{i}")))
        .collect();
    let net = TierNet {
        ns: Netns(
            all.clone(),
            PathBuf::from(format!("/sys/fs/bpf/rserpool-tier-{tag}")),
        ),
        client: client.clone(),
        router: router.clone(),
        proxies: px.clone(),
        servers: sv.clone(),
        pins,
        bpffs,
    };
    for n in &all {
        ip(&format!("netns add {n}"));
        ip(&format!("-n {n} link set lo up"));
    }
    let sysctl = |ns: &str, kv: &str| {
        let ok = Command::new("ip")
            .args(["netns", "exec", ns, "sysctl", "-qw", kv])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "sysctl {kv} in {ns}");
    };
    sysctl(&router, "net.ipv4.ip_forward=1");
    sysctl(&router, "net.ipv4.fib_multipath_hash_policy=1");
    // Over veth a packet keeps its sender's socket hash (skb->hash), which the router's
    // multipath hash then takes as the flow's; TCP draws a new one after a retransmission
    // timeout (to route around a failure), and the flow would move to another proxy. On
    // real links the router hashes the headers. So the ends keep theirs.
    for n in sv.iter().chain([&client]) {
        sysctl(n, "net.core.txrehash=0");
    }
    ip(&format!(
        "-n {client} link add t0 type veth peer name rc netns {router}"
    ));
    ip(&format!("-n {client} addr add 10.88.0.2/24 dev t0"));
    ip(&format!("-n {router} addr add 10.88.0.1/24 dev rc"));
    for (bridge, addr) in [("brp", "10.88.1.1/24"), ("brs", "10.88.2.1/24")] {
        ip(&format!("-n {router} link add {bridge} type bridge"));
        ip(&format!("-n {router} addr add {addr} dev {bridge}"));
        ip(&format!("-n {router} link set {bridge} up"));
    }
    // Each proxy and server: a veth from its t0 to a port of its segment's bridge.
    let hosts = px
        .iter()
        .enumerate()
        .map(|(i, p)| (p, "rp", "brp", TierNet::proxy_addr(i + 1), i));
    let hosts = hosts.chain(
        sv.iter()
            .enumerate()
            .map(|(j, s)| (s, "rs", "brs", TierNet::server_addr(j + 1), j)),
    );
    for (n, prefix, bridge, addr, k) in hosts {
        let port = format!("{prefix}{}", k + 1);
        ip(&format!(
            "-n {n} link add t0 type veth peer name {port} netns {router}"
        ));
        ip(&format!("-n {router} link set {port} master {bridge}"));
        ip(&format!("-n {router} link set {port} up"));
        ip(&format!("-n {n} addr add {addr}/24 dev t0"));
    }
    for p in &px {
        ip(&format!("-n {p} addr add {TIER_VIP}/32 dev lo"));
        ip(&format!("-n {p} addr add {TIER_SHARED}/32 dev lo"));
    }
    ip(&format!("-n {router} link set rc up"));
    for n in px.iter().chain(&sv).chain([&client]) {
        ip(&format!("-n {n} link set t0 up"));
    }
    ip(&format!("-n {client} route add default via 10.88.0.1"));
    for p in &px {
        ip(&format!("-n {p} route add default via {}", TierNet::ROUTER));
    }
    for s in &sv {
        ip(&format!("-n {s} route add default via 10.88.2.1"));
    }
    Some(net)
}
