// SPDX-License-Identifier: MIT OR Apache-2.0
//
// The kernel splice datapath (docs/KSPLICE.md): a TC program that translates the packets of a
// spliced TCP connection from one leg to the other and forwards them, so that they never
// reach the proxy's sockets.
//
// One map entry per direction, keyed by the packet's 4-tuple as it arrives. It says what the
// packet becomes on the other leg: addresses and ports, and the offsets added to its sequence
// and acknowledgement numbers (the two legs' initial sequence numbers differ) and to its
// timestamps (each leg's clocks differ). SACK blocks are acknowledgement-space numbers and
// move with the acknowledgement offset. Checksums are fixed incrementally. The packet then
// leaves by the entry's interface through the kernel's neighbour table (bpf_redirect_neigh).
//
// Entry states (flags):
// - WATCH: the connection still runs through the proxy's sockets; packets pass untouched and
//   the program records the sender's latest TSval, which the hand-over needs (no socket
//   option exposes it).
// - HOLD: the connection is being handed over; its data, SYN and FIN packets are dropped
//   (and recorded), and their senders send them again once the entry is complete. Pure
//   ACKs pass, so that the proxy's sockets can drain while held.
// - neither: spliced. A FIN marks its direction (user space expires the pair once both are
//   marked and quiet); an RST ends the connection: both entries go at once, as they do when
//   a SYN opens a new connection on the addresses and ports of one that was closing.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <stddef.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "abi.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FLOWS_MAX);
	__type(key, struct flow_key);
	__type(value, struct flow_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} FLOWS_MAP SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} COUNTERS_MAP SEC(".maps");

// The proxy tier (docs/TIER.md): proxies share the server-facing address, and the router may
// hand a PE's packet for a connection that is not spliced yet (still on a proxy's sockets) to
// any of them. Each proxy connects from ports of its own range; a packet to a shared address
// and a port in another member's range, with no entry here, goes to that member's MAC on the
// interface it came in by. The member's own range is not in the map.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, TIER_MAX);
	__type(key, __u32);
	__type(value, struct tier_member);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} TIER_MAP SEC(".maps");

// Per-CPU, index 0: packets sent on to another member of the tier.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} TIER_REDIRECTS_MAP SEC(".maps");

#define TCPOPT_SACK 5
#define TCPOPT_TIMESTAMP 8

#define ETH_OFF 0
#define IP_OFF (ETH_OFF + sizeof(struct ethhdr))
#define IP_CSUM_OFF (IP_OFF + offsetof(struct iphdr, check))
#define IP_SRC_OFF (IP_OFF + offsetof(struct iphdr, saddr))
#define IP_DST_OFF (IP_OFF + offsetof(struct iphdr, daddr))

// A 4-byte value as the checksum sees it at an odd offset from the TCP header: its bytes
// b0 b1 b2 b3 fall into the 16-bit words (x b0) (b1 b2) (b3 y), which add up as those of
// b3 b0 b1 b2 would at an even one. (Options need not be aligned: one NOP before a timestamp
// puts its numbers there.)
static __always_inline __u32 straddling(__u32 be)
{
	__u32 n = bpf_ntohl(be);
	return bpf_htonl((n >> 8) | (n << 24));
}

// Rewrites a 4- or 2-byte field of the TCP header (or options) at `off`, fixing the checksum.
// The values are in network byte order; a 2-byte one in the low half. A 4-byte field may sit at
// an odd offset (the options); a 2-byte one is a header field, always at an even one.
static __always_inline int set_field(struct __sk_buff *skb, __u32 tcp_off, __u32 off, __u32 old_be,
				     __u32 new_be, int size)
{
	if (old_be == new_be)
		return 0;
	__u32 old_sum = old_be, new_sum = new_be;
	if (size == 4 && ((off - tcp_off) & 1)) {
		old_sum = straddling(old_be);
		new_sum = straddling(new_be);
	}
	if (bpf_l4_csum_replace(skb, tcp_off + offsetof(struct tcphdr, check), old_sum, new_sum,
				size))
		return -1;
	if (size == 2) {
		__u16 v = new_be;
		return bpf_skb_store_bytes(skb, off, &v, 2, 0);
	}
	return bpf_skb_store_bytes(skb, off, &new_be, 4, 0);
}

#define set32(skb, tcp_off, off, o, n) set_field(skb, tcp_off, off, o, n, 4)
#define set16(skb, tcp_off, off, o, n) set_field(skb, tcp_off, off, o, n, 2)

// An address: the IP header checksum and the TCP pseudo-header checksum both change.
static __always_inline int set_addr(struct __sk_buff *skb, __u32 tcp_off, __u32 off, __u32 old_be,
				    __u32 new_be)
{
	if (old_be == new_be)
		return 0;
	if (bpf_l4_csum_replace(skb, tcp_off + offsetof(struct tcphdr, check), old_be, new_be,
				BPF_F_PSEUDO_HDR | 4))
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old_be, new_be, 4))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new_be, 4, 0);
}

// Walks the TCP options. With `rewrite`, SACK edges (acknowledgement-space numbers) move by
// `sack_delta`, TSval by `tsval_delta` and TSecr by `tsecr_delta`. Without, it only finds the
// TSval. Returns the TSval found (or 0 with *found = 0), or -1 on error. The options are read
// with bpf_skb_load_bytes at computed offsets (the verifier accepts variable packet offsets
// through the helper, not variable stack offsets).
static __always_inline int walk_options(struct __sk_buff *skb, __u32 tcp_off, __u32 doff,
					int rewrite, __u32 sack_delta, __u32 tsval_delta,
					__u32 tsecr_delta, __u32 *tsval, int *found)
{
	__u32 start = tcp_off + sizeof(struct tcphdr);
	__u32 stop = tcp_off + doff;
	__u32 at = start;
	*found = 0;
	for (int n = 0; n < 20; n++) {
		__u8 kind_len[2];
		if (at >= stop)
			break;
		if (bpf_skb_load_bytes(skb, at, kind_len, 1))
			return -1;
		if (kind_len[0] == 0)
			break;
		if (kind_len[0] == 1) {
			at++;
			continue;
		}
		if (at + 2 > stop || bpf_skb_load_bytes(skb, at, kind_len, 2))
			return -1;
		__u32 olen = kind_len[1];
		if (olen < 2 || at + olen > stop)
			break;
		if (kind_len[0] == TCPOPT_TIMESTAMP && olen == 10) {
			__u32 ts[2];
			if (bpf_skb_load_bytes(skb, at + 2, ts, 8))
				return -1;
			*tsval = bpf_ntohl(ts[0]);
			*found = 1;
			if (rewrite) {
				if (set32(skb, tcp_off, at + 2, ts[0],
					  bpf_htonl(bpf_ntohl(ts[0]) + tsval_delta)))
					return -1;
				if (tsecr_delta &&
				    set32(skb, tcp_off, at + 6, ts[1],
					  bpf_htonl(bpf_ntohl(ts[1]) + tsecr_delta)))
					return -1;
			}
		} else if (kind_len[0] == TCPOPT_SACK && rewrite && sack_delta) {
			__u32 edges = (olen - 2) / 4;
			for (__u32 e = 0; e < 8; e++) {
				if (e >= edges)
					break;
				__u32 off = at + 2 + e * 4;
				__u32 old_be;
				if (bpf_skb_load_bytes(skb, off, &old_be, 4))
					return -1;
				__u32 new_be = bpf_htonl(bpf_ntohl(old_be) + sack_delta);
				if (set32(skb, tcp_off, off, old_be, new_be))
					return -1;
			}
		}
		at += olen;
	}
	return 0;
}

// Records the sender's TSval in the entry of a watched or held connection.
static __always_inline void record_ts(struct __sk_buff *skb, struct flow_val *v, __u32 tcp_off,
				      __u32 doff)
{
	__u32 tsval = 0;
	int found = 0;
	v->last_ns = bpf_ktime_get_ns();
	if (doff <= sizeof(struct tcphdr))
		return;
	if (walk_options(skb, tcp_off, doff, 0, 0, 0, 0, &tsval, &found) == 0 && found) {
		v->ts_recent = tsval;
		v->flags |= FLAG_SAW_TS;
	}
}

// Removes both entries of the connection whose entry `v` (keyed `key`) is.
static __always_inline void forget(struct flow_val *v, struct flow_key *key)
{
	struct flow_key back = {
		.saddr = v->daddr,
		.daddr = v->saddr,
		.sport = v->dport,
		.dport = v->sport,
	};
	bpf_map_delete_elem(&FLOWS_MAP, &back);
	bpf_map_delete_elem(&FLOWS_MAP, key);
}

// A packet without an entry: to the member of the tier whose port it is addressed to, if any.
static __always_inline int tier_redirect(struct __sk_buff *skb, __u32 daddr, __u16 dport_be)
{
	__u16 port = bpf_ntohs(dport_be);
	for (__u32 i = 0; i < TIER_MAX; i++) {
		__u32 slot = i;
		struct tier_member *m = bpf_map_lookup_elem(&TIER_MAP, &slot);
		if (!m || m->addr == 0)
			break;
		if (m->addr != daddr || port < m->port_lo || port > m->port_hi)
			continue;
		if (bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), m->mac, ETH_ALEN, 0) ||
		    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_source), m->src, ETH_ALEN, 0))
			return TC_ACT_SHOT;
		__u32 zero = 0;
		__u64 *n = bpf_map_lookup_elem(&TIER_REDIRECTS_MAP, &zero);
		if (n)
			*n += 1;
		return bpf_redirect(skb->ifindex, 0);
	}
	return TC_ACT_OK;
}

SEC("classifier")
int splice_tc(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
		return TC_ACT_OK;
	if (ip->frag_off & bpf_htons(0x3fff))
		return TC_ACT_OK;
	struct tcphdr *tcp = (void *)(ip + 1);
	if ((void *)(tcp + 1) > end)
		return TC_ACT_OK;

	struct flow_key key = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.sport = tcp->source,
		.dport = tcp->dest,
	};
	struct flow_val *v = bpf_map_lookup_elem(&FLOWS_MAP, &key);
	if (!v)
		return tier_redirect(skb, key.daddr, key.dport);
	__u32 tcp_off = IP_OFF + sizeof(struct iphdr);
	__u32 doff = tcp->doff * 4;
	if (v->flags & (FLAG_HOLD | FLAG_WATCH)) {
		// Held: what would move a socket's sequence numbers (data, SYN, FIN) is dropped,
		// to be sent again through the splice; pure ACKs (and RSTs) pass, so that the
		// proxy's sockets can drain what they sent.
		int moves = bpf_ntohs(ip->tot_len) > sizeof(struct iphdr) + doff || tcp->syn ||
			    tcp->fin;
		record_ts(skb, v, tcp_off, doff);
		return (v->flags & FLAG_HOLD) && moves ? TC_ACT_SHOT : TC_ACT_OK;
	}
	if (tcp->syn && !tcp->ack && (v->flags & FLAG_FIN)) {
		// A new connection on the 4-tuple of a spliced one that was closing (a client that
		// reused its port): the old one is over. Its entries go, and the SYN goes up to the
		// proxy's listener.
		forget(v, &key);
		return TC_ACT_OK;
	}
	__u32 seq_be = tcp->seq, ack_be = tcp->ack_seq;
	__u16 window_be = tcp->window;
	int syn = tcp->syn;
	__u16 sport_be = tcp->source, dport_be = tcp->dest;
	__u32 saddr_be = ip->saddr, daddr_be = ip->daddr;
	int is_ack = tcp->ack, fin = tcp->fin, rst = tcp->rst;
	__u32 len = skb->len;
	__u32 payload = bpf_ntohs(ip->tot_len) - sizeof(struct iphdr) - doff;
	// From here on the packet pointers are stale: helpers below may move the data.

	if (set32(skb, tcp_off, tcp_off + offsetof(struct tcphdr, seq), seq_be,
		  bpf_htonl(bpf_ntohl(seq_be) + v->seq_delta)))
		return TC_ACT_SHOT;
	if (is_ack) {
		if (set32(skb, tcp_off, tcp_off + offsetof(struct tcphdr, ack_seq), ack_be,
			  bpf_htonl(bpf_ntohl(ack_be) + v->ack_delta)))
			return TC_ACT_SHOT;
	}
	__u16 flags = v->flags;
	if (doff > sizeof(struct tcphdr) && ((is_ack && v->ack_delta) || (flags & FLAG_TS))) {
		__u32 tsval = 0;
		int found = 0;
		__u32 tsval_delta = (flags & FLAG_TS) ? v->tsval_delta : 0;
		__u32 tsecr_delta = (flags & FLAG_TS) && is_ack ? v->tsecr_delta : 0;
		if (walk_options(skb, tcp_off, doff, 1, is_ack ? v->ack_delta : 0, tsval_delta,
				 tsecr_delta, &tsval, &found))
			return TC_ACT_SHOT;
	}
	// A SYN's window is never scaled.
	if (!syn && v->wscale_in != v->wscale_out) {
		__u32 bytes = (__u32)bpf_ntohs(window_be) << (v->wscale_in & 15);
		__u32 w = bytes >> (v->wscale_out & 15);
		if (w > 0xffff)
			w = 0xffff;
		if (set16(skb, tcp_off, tcp_off + offsetof(struct tcphdr, window), window_be,
			  bpf_htons((__u16)w)))
			return TC_ACT_SHOT;
	}
	if (set16(skb, tcp_off, tcp_off + offsetof(struct tcphdr, source), sport_be, v->sport) ||
	    set16(skb, tcp_off, tcp_off + offsetof(struct tcphdr, dest), dport_be, v->dport) ||
	    set_addr(skb, tcp_off, IP_SRC_OFF, saddr_be, v->saddr) ||
	    set_addr(skb, tcp_off, IP_DST_OFF, daddr_be, v->daddr))
		return TC_ACT_SHOT;

	__u32 ifindex = v->ifindex;
	v->last_ns = bpf_ktime_get_ns();
	__sync_fetch_and_add(&v->packets, 1);
	__sync_fetch_and_add(&v->bytes, payload);
	if (fin)
		v->flags |= FLAG_FIN;
	if (is_ack && (flags & FLAG_PROBE)) {
		v->probe_ack = bpf_ntohl(ack_be) + v->ack_delta;
		v->flags = (v->flags & ~FLAG_PROBE) | FLAG_PROBED;
	}
	// Nothing answers an RST: the connection is over in both directions.
	if (rst)
		forget(v, &key);

	__u32 zero = 0;
	struct counters *c = bpf_map_lookup_elem(&COUNTERS_MAP, &zero);
	if (c) {
		c->packets++;
		c->bytes += len;
		c->fins += fin;
		c->rsts += rst;
	}
	return bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
