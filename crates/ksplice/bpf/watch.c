// SPDX-License-Identifier: MIT OR Apache-2.0
//
// The distributor's traffic watch (docs/TIER.md, "Finding a dead proxy"): TC programs on the
// router's interface towards the proxies that count, per proxy MAC address, the frames the
// router sent to it (egress) and the frames it sent (ingress). A proxy that keeps being sent
// packets and sends none is dead long before its heartbeats say so. Only the MAC addresses
// user space put in the map are counted: the map never grows.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "abi.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, WATCH_MAX);
	__type(key, __u64); // the MAC address in the low 6 bytes (memory order)
	__type(value, struct traffic);
} WATCH_MAP SEC(".maps");

static __always_inline __u64 mac_key(const unsigned char *mac)
{
	__u64 k = 0;
	__builtin_memcpy(&k, mac, ETH_ALEN);
	return k;
}

// Counts the frame for the proxy whose MAC address it comes from (`egress` 0) or goes to.
static __always_inline int count(struct __sk_buff *skb, int egress)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	__u64 k = mac_key(egress ? eth->h_dest : eth->h_source);
	struct traffic *t = bpf_map_lookup_elem(&WATCH_MAP, &k);
	if (t)
		__sync_fetch_and_add(egress ? &t->to : &t->from, 1);
	return TC_ACT_OK;
}

SEC("classifier")
int watch_in(struct __sk_buff *skb)
{
	return count(skb, 0);
}

SEC("classifier")
int watch_out(struct __sk_buff *skb)
{
	return count(skb, 1);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
