// SPDX-License-Identifier: MIT OR Apache-2.0
//
// What the datapath (splice.c, watch.c, conncount.c) and its loader (src/, Rust) share: the maps' names,
// sizes and value layouts, and the flags. build.rs compiles this header with the host's C
// compiler and checks the Rust structs against it field by field; the build fails where they
// differ. So: change a struct here and in src/ together.
//
// Fixed-width types only, every field at its natural alignment and no implicit padding (build.rs
// checks that too): the layout is then the same for clang -target bpf and for the host.

#ifndef RSERPOOL_KSPLICE_ABI_H
#define RSERPOOL_KSPLICE_ABI_H

#include <linux/types.h>

// The maps' names, which are their pinned files' names too.
#define FLOWS_MAP splice_flows
#define COUNTERS_MAP splice_counters
#define TIER_MAP splice_tier
#define TIER_REDIRECTS_MAP splice_tier_redirects
#define WATCH_MAP watch_macs
#define CONNCOUNT_MAP conncount_ports

// The flow table's size in the object; the loader sets its own.
#define FLOWS_MAX 65536

// A packet's 4-tuple as it arrives, network byte order: the flow table's key.
struct flow_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
};

struct flow_val {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u32 seq_delta;
	__u32 ack_delta;
	// Added to TSval and to TSecr of the timestamp option (FLAG_TS).
	__u32 tsval_delta;
	__u32 tsecr_delta;
	__u32 ifindex;
	// The window field is in units of 2^wscale_in on arrival and must leave in units of
	// 2^wscale_out (the two legs negotiated their window scales apart).
	__u8 wscale_in;
	__u8 wscale_out;
	__u16 flags;
	// Written by the program: the sender's latest TSval (FLAG_SAW_TS), when the latest
	// packet came (bpf_ktime_get_ns), packets and payload bytes carried.
	__u32 ts_recent;
	__u64 last_ns;
	__u64 packets;
	__u64 bytes;
	// FLAG_PROBE: the acknowledgement number of the first ACK carried after user space armed
	// the entry, as it left (the receiver's SND.UNA if nothing newer is in flight); then
	// FLAG_PROBED replaces FLAG_PROBE. The tier's nudge after a member died reads it.
	__u32 probe_ack;
	__u32 pad;
};

// flow_val.flags: the entry's state (splice.c says what each does).
#define FLAG_HOLD 1
#define FLAG_WATCH 2
#define FLAG_TS 4
#define FLAG_SAW_TS 8
#define FLAG_FIN 16
#define FLAG_PROBE 32
#define FLAG_PROBED 64

// Per-CPU counters, index 0: packets, bytes, FINs, RSTs of spliced connections.
struct counters {
	__u64 packets;
	__u64 bytes;
	__u64 fins;
	__u64 rsts;
};

// Another proxy of the tier: packets to `addr` with a destination port in
// [port_lo, port_hi] and no flow entry go to it.
struct tier_member {
	__u32 addr; // the shared address, network byte order; 0: an empty slot
	__u16 port_lo; // host byte order
	__u16 port_hi;
	__u8 mac[6]; // the member's
	__u8 src[6]; // this proxy's on the shared segment: a bridge must not learn the router's MAC
		     // from the redirected frame
};

// Slots of the tier map: the most other members a tier's datapath forwards to.
#define TIER_MAX 16

// watch.c: frames counted for one proxy MAC address (the key: the address in the low 6
// bytes of a __u64, memory order).
struct traffic {
	__u64 from; // frames from the proxy
	__u64 to;   // frames to it
};

// Slots of the watch map.
#define WATCH_MAX 256

// conncount.c: a listening port in one network namespace, and its count.
struct conn_port {
	__u64 netns; // the namespace's cookie (SO_NETNS_COOKIE)
	__u32 port;  // host byte order
	__u32 zero;
};

struct conn_count {
	__s64 established; // connections that became established since the port was added, less those that left the state
	__u64 changes;     // events counted (both ways)
};

// Slots of the conncount map: ports counted by one loader.
#define CONNCOUNT_MAX 64

#endif
