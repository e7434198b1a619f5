//! The datapath run on packets built here, one at a time, through `BPF_PROG_TEST_RUN` (the
//! `bpf(2)` command that runs a loaded program on a given packet and returns what became of
//! the packet and the program's return code). No network namespace, no interface: the program
//! is loaded by `Datapath::load` with no interfaces, and the flow table is filled through the
//! crate's own API. Each translation is checked against what the flow entry says it should be
//! (computed here from the `Splice`, not read back from the program), and every checksum is
//! recomputed from scratch.
//!
//! What test-run cannot show: a redirect (`bpf_redirect_neigh`, `bpf_redirect`) only returns
//! `TC_ACT_REDIRECT` there and nothing is sent, so where a packet goes is the namespace tests'
//! business (`netns.rs`). And the skb carries no checksum state (`CHECKSUM_NONE`, which no
//! test-run context can change): the incremental fixes rewrite the checksum fields, as for a
//! packet whose checksum the NIC did not check, but what `BPF_F_PSEUDO_HDR` adds for
//! `CHECKSUM_COMPLETE` and `CHECKSUM_PARTIAL` packets (a NIC's verified sum, an offloaded one)
//! does not show here.
//!
//! Needs root and a build with clang; without them the tests are skipped, except under `CI`,
//! where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_ksplice::testbed::datapath_test;
use rserpool_ksplice::{Datapath, Splice, TierMember};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

// ---- Running the program ------------------------------------------------------------------

/// A datapath of its own (its maps pinned in a directory of its own), attached nowhere.
struct Loaded {
    dp: Datapath,
    pins: PathBuf,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = Datapath::remove_all(&[], &self.pins);
    }
}

/// The datapath, loaded, or `None`: skipped (says why; fails under `CI`).
fn load() -> Option<Loaded> {
    let n = datapath_test("the test-run tests need root (loading eBPF)")?;
    let pins = PathBuf::from(format!(
        "/sys/fs/bpf/rserpool-prog-run-{}-{n}",
        std::process::id()
    ));
    let _ = Datapath::remove_all(&[], &pins);
    let dp = Datapath::load(&[], 64, &pins).unwrap();
    Some(Loaded { dp, pins })
}

/// `union bpf_attr` as `BPF_PROG_TEST_RUN` reads it (linux/bpf.h, the `test` member). aya
/// 0.13 has no wrapper for the command: the raw syscall it is.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    // The kernel wants every byte past `batch_size` zero.
    _pad: u32,
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// Runs the program once on `frame`: its return code and the frame it left.
fn run(dp: &Datapath, frame: &[u8]) -> (u32, Vec<u8>) {
    use std::os::fd::AsRawFd;
    let fd = dp.program_fd().unwrap();
    let mut out = vec![0u8; frame.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: fd.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        ..TestRunAttr::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix for BPF_PROG_TEST_RUN of the size passed;
    // the kernel reads `frame.len()` bytes of `frame` and writes at most `out.len()` bytes
    // into `out`, both of which live across the call; `fd` is an open program's.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            std::mem::size_of::<TestRunAttr>() as u32,
        )
    };
    assert_eq!(
        rc,
        0,
        "BPF_PROG_TEST_RUN: {}",
        std::io::Error::last_os_error()
    );
    out.truncate(attr.data_size_out as usize);
    (attr.retval, out)
}

// ---- Packets ------------------------------------------------------------------------------

const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// An Ethernet/IPv4/TCP packet, as built and as parsed back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tcp {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    window: u16,
    options: Vec<u8>,
    payload: Vec<u8>,
}

impl Tcp {
    fn new(src: SocketAddrV4, dst: SocketAddrV4, seq: u32, ack: u32, flags: u8) -> Self {
        Self {
            src,
            dst,
            seq,
            ack,
            flags,
            window: 1000,
            options: Vec::new(),
            payload: Vec::new(),
        }
    }

    fn options(mut self, options: Vec<u8>) -> Self {
        assert_eq!(options.len() % 4, 0);
        self.options = options;
        self
    }

    fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    fn window(mut self, window: u16) -> Self {
        self.window = window;
        self
    }

    /// The frame, with correct IPv4 and TCP checksums.
    fn frame(&self) -> Vec<u8> {
        let tcp_len = 20 + self.options.len() + self.payload.len();
        let mut f = Vec::new();
        f.extend(MAC_DST);
        f.extend(MAC_SRC);
        f.extend(0x0800u16.to_be_bytes());
        f.extend([0x45, 0]);
        f.extend(((20 + tcp_len) as u16).to_be_bytes());
        f.extend(0x1234u16.to_be_bytes()); // id
        f.extend(0x4000u16.to_be_bytes()); // DF
        f.extend([64, 6, 0, 0]); // TTL, TCP, checksum
        f.extend(self.src.ip().octets());
        f.extend(self.dst.ip().octets());
        f.extend(self.src.port().to_be_bytes());
        f.extend(self.dst.port().to_be_bytes());
        f.extend(self.seq.to_be_bytes());
        f.extend(self.ack.to_be_bytes());
        f.push((((20 + self.options.len()) / 4) as u8) << 4);
        f.push(self.flags);
        f.extend(self.window.to_be_bytes());
        f.extend([0, 0, 0, 0]); // checksum, urgent pointer
        f.extend(&self.options);
        f.extend(&self.payload);
        let ip = !fold(sum(&f[14..34], 0));
        f[24..26].copy_from_slice(&ip.to_be_bytes());
        let tcp = !fold(sum(&f[34..], pseudo_header(&f)));
        f[50..52].copy_from_slice(&tcp.to_be_bytes());
        f
    }

    /// Reads a frame back (IPv4 without options, TCP), checking both checksums from scratch.
    fn parse(f: &[u8]) -> Self {
        assert_eq!(&f[12..14], &[0x08, 0x00], "not IPv4");
        assert_eq!(f[14], 0x45, "IPv4 with options");
        let tot_len = u16::from_be_bytes([f[16], f[17]]) as usize;
        assert_eq!(
            f.len(),
            14 + tot_len,
            "the frame's length is not the IP length"
        );
        assert_eq!(f[23], 6, "not TCP");
        assert_eq!(fold(sum(&f[14..34], 0)), 0xffff, "bad IPv4 header checksum");
        assert_eq!(
            fold(sum(&f[34..], pseudo_header(f))),
            0xffff,
            "bad TCP checksum"
        );
        let ip = |at: usize| Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3]);
        let u16_at = |at: usize| u16::from_be_bytes([f[at], f[at + 1]]);
        let u32_at = |at: usize| u32::from_be_bytes([f[at], f[at + 1], f[at + 2], f[at + 3]]);
        let doff = (f[46] >> 4) as usize * 4;
        Self {
            src: SocketAddrV4::new(ip(26), u16_at(34)),
            dst: SocketAddrV4::new(ip(30), u16_at(36)),
            seq: u32_at(38),
            ack: u32_at(42),
            flags: f[47],
            window: u16_at(48),
            options: f[54..34 + doff].to_vec(),
            payload: f[34 + doff..].to_vec(),
        }
    }

    /// The timestamp option's TSval and TSecr.
    fn timestamps(&self) -> Option<(u32, u32)> {
        option(&self.options, 8).map(|d| {
            (
                u32::from_be_bytes([d[0], d[1], d[2], d[3]]),
                u32::from_be_bytes([d[4], d[5], d[6], d[7]]),
            )
        })
    }

    /// The SACK option's blocks.
    fn sack(&self) -> Vec<(u32, u32)> {
        option(&self.options, 5)
            .map(|d| {
                d.chunks(8)
                    .map(|b| {
                        (
                            u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
                            u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The data of the TCP option `kind` in `options`.
fn option(options: &[u8], kind: u8) -> Option<&[u8]> {
    let mut at = 0;
    while at < options.len() {
        match options[at] {
            0 => return None,
            1 => at += 1,
            k => {
                let len = options[at + 1] as usize;
                if k == kind {
                    return Some(&options[at + 2..at + len]);
                }
                at += len;
            }
        }
    }
    None
}

/// NOP, NOP, timestamps.
fn ts_option(tsval: u32, tsecr: u32) -> Vec<u8> {
    let mut o = vec![1, 1, 8, 10];
    o.extend(tsval.to_be_bytes());
    o.extend(tsecr.to_be_bytes());
    o
}

/// NOP, NOP, SACK blocks.
fn sack_option(blocks: &[(u32, u32)]) -> Vec<u8> {
    let mut o = vec![1, 1, 5, 2 + 8 * blocks.len() as u8];
    for (l, r) in blocks {
        o.extend(l.to_be_bytes());
        o.extend(r.to_be_bytes());
    }
    o
}

/// The ones' complement sum of `data` as 16-bit words, added to `acc`.
fn sum(data: &[u8], mut acc: u32) -> u32 {
    for w in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The TCP pseudo-header's sum for the IPv4 frame `f`.
fn pseudo_header(f: &[u8]) -> u32 {
    let tcp_len = (f.len() - 34) as u32;
    sum(&f[26..34], 6 + tcp_len)
}

// ---- The connection -----------------------------------------------------------------------

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// A splice with offsets that wrap, window scales that differ and timestamps.
fn splice() -> Splice {
    Splice {
        client: addr("10.77.1.2:40000"),
        front: addr("10.77.1.1:8080"),
        back: addr("10.77.2.1:40001"),
        server: addr("10.77.2.2:9000"),
        client_seq_delta: 0x9e37_79b9,
        server_seq_delta: 0x7f4a_7c15,
        client_if: 1,
        server_if: 1,
        client_wscale: 7,
        front_wscale: 9,
        server_wscale: 2,
        back_wscale: 2,
        timestamps: Some((0x8000_0100, 0xffff_f000)),
    }
}

/// The client's TSval offset and the server's.
fn ts_deltas(s: &Splice) -> (u32, u32) {
    s.timestamps.unwrap_or((0, 0))
}

/// A window of `w` in units of 2^`from` as it should leave in units of 2^`to`.
fn rescaled(w: u16, from: u8, to: u8) -> u16 {
    ((u32::from(w) << from) >> to).min(0xffff) as u16
}

/// The packet of the client's that everything applies to: data with an ACK, timestamps and
/// three SACK blocks (40 bytes of options, the most there are).
fn client_data(s: &Splice) -> Tcp {
    let options = [
        ts_option(0xffff_ff00, 0x0000_0010),
        sack_option(&[
            (0xffff_fff0, 0x0000_0100),
            (0x1000_0000, 0x1000_05b4),
            (0x8000_0000, 0x8000_1000),
        ]),
    ]
    .concat();
    Tcp::new(s.client, s.front, 0xfff0_0000, 0x0000_1000, ACK | PSH)
        .options(options)
        .payload(b"the client's bytes")
}

fn assert_unchanged(dp: &Datapath, frame: &[u8], what: &str) {
    let (rc, out) = run(dp, frame);
    assert_eq!(rc, TC_ACT_OK, "{what}: not passed on");
    assert_eq!(out, frame, "{what}: changed");
}

// ---- The tests ----------------------------------------------------------------------------

#[test]
fn a_client_packet_leaves_in_the_server_legs_numbers() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    let (client_ts, server_ts) = ts_deltas(&s);
    let sent = client_data(&s);
    let frame = sent.frame();
    let (rc, out) = run(dp, &frame);
    assert_eq!(rc, TC_ACT_REDIRECT);
    // Ethernet is the neighbour lookup's after the redirect; the program leaves it.
    assert_eq!(out[..14], frame[..14]);
    // TTL, identification, fragment bits and length untouched.
    assert_eq!(out[14..24], frame[14..24]);
    let got = Tcp::parse(&out);
    assert_eq!((got.src, got.dst), (s.back, s.server));
    assert_eq!(got.seq, sent.seq.wrapping_add(s.client_seq_delta));
    // The server's numbers came to the client less the server's offset: back they go.
    assert_eq!(got.ack, sent.ack.wrapping_sub(s.server_seq_delta));
    let sack: Vec<_> = sent
        .sack()
        .iter()
        .map(|(l, r)| {
            (
                l.wrapping_sub(s.server_seq_delta),
                r.wrapping_sub(s.server_seq_delta),
            )
        })
        .collect();
    assert_eq!(got.sack(), sack);
    assert_eq!(sack.len(), 3);
    let (tsval, tsecr) = sent.timestamps().unwrap();
    assert_eq!(
        got.timestamps(),
        Some((tsval.wrapping_add(client_ts), tsecr.wrapping_sub(server_ts)))
    );
    assert_eq!(
        got.window,
        rescaled(sent.window, s.client_wscale, s.back_wscale)
    );
    assert_eq!(got.flags, sent.flags);
    assert_eq!(got.payload, sent.payload);
    // The option bytes around the numbers (NOPs, kinds, lengths) stay.
    assert_eq!(got.options.len(), sent.options.len());
    for i in [0, 1, 2, 3, 12, 13, 14, 15] {
        assert_eq!(got.options[i], sent.options[i], "option byte {i}");
    }

    let carried = dp.carried(&s).unwrap();
    assert_eq!(carried[0], (1, sent.payload.len() as u64));
    assert_eq!(carried[1], (0, 0));
    let c = dp.counters().unwrap();
    assert_eq!((c.packets, c.bytes), (1, frame.len() as u64));
    assert_eq!((c.fins, c.rsts), (0, 0));
}

#[test]
fn a_server_packet_leaves_in_the_client_legs_numbers_and_acknowledges_what_the_client_sent() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    let (_, server_ts) = ts_deltas(&s);
    // The client's data, as the server receives it.
    let sent = client_data(&s);
    let (_, at_server) = run(dp, &sent.frame());
    let at_server = Tcp::parse(&at_server);
    let (tsval_at_server, _) = at_server.timestamps().unwrap();
    // The server acknowledges it and echoes its timestamp, and sends data of its own.
    let end = at_server.seq.wrapping_add(at_server.payload.len() as u32);
    let reply = Tcp::new(s.server, s.back, 0x0000_0005, end, ACK)
        .window(60000)
        // Laid out unlike the client's: one NOP, so that every number sits at an odd offset
        // (the checksum's 16-bit words straddle them), and an end of list.
        .options(
            [
                vec![1],
                ts_option(0x7000_0000, tsval_at_server)[2..].to_vec(),
                sack_option(&[(end.wrapping_add(100), end.wrapping_add(200))])[2..].to_vec(),
                vec![0, 0, 0],
            ]
            .concat(),
        )
        .payload(b"the server's answer");
    let (rc, out) = run(dp, &reply.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let got = Tcp::parse(&out);
    assert_eq!((got.src, got.dst), (s.front, s.client));
    assert_eq!(got.seq, reply.seq.wrapping_add(s.server_seq_delta));
    // In the client's numbers: the end of what it sent, and its own clock echoed.
    assert_eq!(got.ack, sent.seq.wrapping_add(sent.payload.len() as u32));
    assert_eq!(
        got.timestamps(),
        Some((
            0x7000_0000u32.wrapping_add(server_ts),
            sent.timestamps().unwrap().0
        ))
    );
    let sent_end = sent.seq.wrapping_add(sent.payload.len() as u32);
    assert_eq!(
        got.sack(),
        vec![(sent_end.wrapping_add(100), sent_end.wrapping_add(200))]
    );
    assert_eq!(
        got.window,
        rescaled(reply.window, s.server_wscale, s.front_wscale)
    );
    assert_eq!(got.payload, reply.payload);
    let carried = dp.carried(&s).unwrap();
    assert_eq!(carried[1], (1, reply.payload.len() as u64));
}

#[test]
fn windows_rescale_and_saturate_but_a_syns_window_is_never_scaled() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = Splice {
        client_wscale: 10,
        back_wscale: 0,
        ..splice()
    };
    dp.splice(&s).unwrap();
    for (w, want) in [
        (3u16, 3072u16),
        (63, 64512),
        (64, 0xffff),
        (0xffff, 0xffff),
        (0, 0),
    ] {
        let sent = Tcp::new(s.client, s.front, 1, 1, ACK).window(w);
        let (rc, out) = run(dp, &sent.frame());
        assert_eq!(rc, TC_ACT_REDIRECT);
        assert_eq!(Tcp::parse(&out).window, want, "window {w}");
    }
    // A SYN of the spliced connection (a retransmission): translated, its window as sent.
    let syn = Tcp::new(s.client, s.front, 0x1000, 0, SYN).window(500);
    let (rc, out) = run(dp, &syn.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let got = Tcp::parse(&out);
    assert_eq!(got.window, 500);
    assert_eq!(got.seq, 0x1000u32.wrapping_add(s.client_seq_delta));
    assert_eq!(got.flags, SYN);
    // Not acknowledging, its acknowledgement field is left alone.
    assert_eq!(got.ack, 0);
}

#[test]
fn without_timestamps_on_both_legs_the_option_is_left_alone() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = Splice {
        timestamps: None,
        ..splice()
    };
    dp.splice(&s).unwrap();
    let sent = client_data(&s);
    let (rc, out) = run(dp, &sent.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let got = Tcp::parse(&out);
    assert_eq!(got.timestamps(), sent.timestamps());
    // The SACK blocks still move.
    assert_eq!(
        got.sack()[0].0,
        sent.sack()[0].0.wrapping_sub(s.server_seq_delta)
    );
}

#[test]
fn a_fin_is_carried_and_marks_its_direction() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    let fin = Tcp::new(s.server, s.back, 77, 88, FIN | ACK).payload(b"last");
    let (rc, out) = run(dp, &fin.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let got = Tcp::parse(&out);
    assert_eq!(got.flags, FIN | ACK);
    assert_eq!(got.seq, 77u32.wrapping_add(s.server_seq_delta));
    assert_eq!(got.ack, 88u32.wrapping_sub(s.client_seq_delta));
    let states = dp.splices().unwrap();
    assert_eq!(states.len(), 1);
    let st = &states[0];
    // fin[0] is the direction from `st.splice.client`, whichever end that is.
    let server_first = st.splice.client == s.server;
    let (server_fin, client_fin) = if server_first {
        (st.fin[0], st.fin[1])
    } else {
        (st.fin[1], st.fin[0])
    };
    assert!(server_fin && !client_fin, "{st:?}");
    let c = dp.counters().unwrap();
    assert_eq!((c.packets, c.fins, c.rsts), (1, 1, 0));
}

#[test]
fn an_rst_is_carried_and_ends_both_directions_at_once() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    let rst = Tcp::new(s.server, s.back, 1234, 5678, RST | ACK);
    let (rc, out) = run(dp, &rst.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let got = Tcp::parse(&out);
    assert_eq!((got.src, got.dst), (s.front, s.client));
    assert_eq!(got.flags, RST | ACK);
    assert_eq!(got.seq, 1234u32.wrapping_add(s.server_seq_delta));
    assert_eq!(got.ack, 5678u32.wrapping_sub(s.client_seq_delta));
    assert!(!dp.contains(s.server, s.back));
    assert!(!dp.contains(s.client, s.front));
    let c = dp.counters().unwrap();
    assert_eq!((c.packets, c.fins, c.rsts), (1, 0, 1));
    // What comes after goes up untouched: the connection is no longer the splice's.
    assert_unchanged(dp, &client_data(&s).frame(), "after the RST");
}

#[test]
fn a_syn_on_a_closing_connections_ports_ends_it_and_goes_up_untouched() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    let (rc, _) = run(dp, &Tcp::new(s.client, s.front, 10, 20, FIN | ACK).frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    assert!(dp.contains(s.client, s.front));
    // The client reuses its port for a new connection.
    let syn = Tcp::new(s.client, s.front, 0x5555_0000, 0, SYN).options(ts_option(9, 0));
    assert_unchanged(dp, &syn.frame(), "the new SYN");
    assert!(!dp.contains(s.client, s.front));
    assert!(!dp.contains(s.server, s.back));
}

#[test]
fn a_held_connection_drops_what_moves_sequence_numbers_and_passes_pure_acks() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.hold(&s, None).unwrap();
    assert_eq!(dp.seen_tsval(s.client, s.front), None);
    for (what, p) in [
        (
            "data",
            Tcp::new(s.client, s.front, 1, 2, ACK | PSH)
                .options(ts_option(1000, 1))
                .payload(b"x"),
        ),
        (
            "a SYN",
            Tcp::new(s.client, s.front, 1, 0, SYN).options(ts_option(1001, 0)),
        ),
        (
            "a FIN",
            Tcp::new(s.client, s.front, 1, 2, FIN | ACK).options(ts_option(1002, 1)),
        ),
    ] {
        let (rc, _) = run(dp, &p.frame());
        assert_eq!(rc, TC_ACT_SHOT, "{what}");
    }
    // What was dropped still told the sender's clock.
    assert_eq!(dp.seen_tsval(s.client, s.front), Some(1002));
    // Pure ACKs pass, and tell the clock too.
    let ack = Tcp::new(s.server, s.back, 3, 4, ACK).options(ts_option(2000, 1002));
    assert_unchanged(dp, &ack.frame(), "a pure ACK");
    assert_eq!(dp.seen_tsval(s.server, s.back), Some(2000));
    // One padded to Ethernet's 60 bytes: the padding is no payload.
    let mut frame = Tcp::new(s.server, s.back, 3, 4, ACK).frame();
    assert_eq!(frame.len(), 54);
    frame.resize(60, 0);
    assert_unchanged(dp, &frame, "a padded pure ACK");
    // An RST passes to the proxy's socket too.
    assert_unchanged(dp, &Tcp::new(s.server, s.back, 3, 0, RST).frame(), "an RST");
    // Nothing counted as carried.
    assert_eq!(dp.counters().unwrap().packets, 0);
}

#[test]
fn a_watched_connection_passes_untouched_and_its_senders_clock_is_recorded() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.watch(s.server, s.back, None).unwrap();
    let p = Tcp::new(s.server, s.back, 1, 2, ACK | PSH)
        .options(ts_option(0xdead_beef, 5))
        .payload(b"through the proxy's socket");
    assert_unchanged(dp, &p.frame(), "watched data");
    assert_eq!(dp.seen_tsval(s.server, s.back), Some(0xdead_beef));
    // Without the option nothing is recorded over it.
    assert_unchanged(
        dp,
        &Tcp::new(s.server, s.back, 1, 2, ACK).frame(),
        "no option",
    );
    assert_eq!(dp.seen_tsval(s.server, s.back), Some(0xdead_beef));
}

#[test]
fn an_armed_entry_records_the_acknowledgement_it_carried() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    assert_eq!(dp.arm_probes().unwrap().len(), 2);
    let ack = Tcp::new(s.server, s.back, 50, 0x0100_0000, ACK);
    let (rc, _) = run(dp, &ack.frame());
    assert_eq!(rc, TC_ACT_REDIRECT);
    let probed = dp.take_probed().unwrap();
    // Only the direction that carried an ACK; its receiver (the client) is told to resend
    // from the acknowledgement number as it left.
    assert_eq!(probed.len(), 1, "{probed:?}");
    assert_eq!((probed[0].from, probed[0].to), (s.client, s.front));
    assert_eq!(
        probed[0].seq,
        0x0100_0000u32.wrapping_sub(s.client_seq_delta)
    );
    assert!(dp.take_probed().unwrap().is_empty());
}

#[test]
fn packets_of_no_spliced_connection_pass_untouched() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let s = splice();
    dp.splice(&s).unwrap();
    // Another port; the splice's output 4-tuple, which is no key.
    assert_unchanged(
        dp,
        &Tcp::new(s.client, addr("10.77.1.1:8081"), 1, 2, ACK).frame(),
        "another port",
    );
    assert_unchanged(
        dp,
        &Tcp::new(s.back, s.server, 1, 2, ACK).frame(),
        "the output's 4-tuple",
    );
    let spliced = client_data(&s).frame();
    // IPv4 with options on the spliced 4-tuple (an IHL of 6, a NOP option word).
    let mut with_options = spliced[..34].to_vec();
    with_options.extend([1, 1, 1, 0]);
    with_options.extend(&spliced[34..]);
    with_options[14] = 0x46;
    with_options[17] += 4; // the total length's low byte
    assert_unchanged(dp, &with_options, "IP options");
    // A fragment.
    let mut fragment = spliced.clone();
    fragment[20] = 0x20; // MF
    assert_unchanged(dp, &fragment, "a fragment");
    // UDP between the same addresses and ports.
    let mut udp = spliced.clone();
    udp[23] = 17;
    assert_unchanged(dp, &udp, "UDP");
    // Not IPv4.
    let mut v6 = spliced;
    v6[12..14].copy_from_slice(&[0x86, 0xdd]);
    assert_unchanged(dp, &v6, "another EtherType");
    assert_eq!(dp.counters().unwrap().packets, 0);
    assert_eq!(dp.carried(&s).unwrap(), [(0, 0), (0, 0)]);
}

#[test]
fn a_packet_for_another_tier_members_port_goes_to_its_mac() {
    let Some(mut l) = load() else { return };
    let dp = &mut l.dp;
    let member = TierMember {
        shared: Ipv4Addr::new(10, 77, 2, 1),
        ports: 41000..=41999,
        mac: [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee],
        src: [0x02, 0x11, 0x22, 0x33, 0x44, 0x55],
    };
    dp.set_tier(std::slice::from_ref(&member)).unwrap();
    let server = addr("10.77.2.2:9000");
    for port in [41000, 41500, 41999] {
        let p = Tcp::new(server, SocketAddrV4::new(member.shared, port), 1, 2, ACK)
            .payload(b"for the other proxy");
        let frame = p.frame();
        let (rc, out) = run(dp, &frame);
        assert_eq!(rc, TC_ACT_REDIRECT, "port {port}");
        assert_eq!(out[0..6], member.mac);
        assert_eq!(out[6..12], member.src);
        assert_eq!(
            out[12..],
            frame[12..],
            "port {port}: more than the MACs changed"
        );
    }
    assert_eq!(dp.tier_redirects().unwrap(), 3);
    // Outside the member's range, or to another address: not the member's.
    for to in ["10.77.2.1:40999", "10.77.2.1:42000", "10.77.2.9:41500"] {
        assert_unchanged(dp, &Tcp::new(server, addr(to), 1, 2, ACK).frame(), to);
    }
    assert_eq!(dp.tier_redirects().unwrap(), 3);
}
