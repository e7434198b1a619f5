// SPDX-License-Identifier: MIT OR Apache-2.0
//
// The `serve` sidecar's connection count (src/conncount.rs): a sock_ops program on a cgroup
// that counts, per listening port user space put in the map, the connections that become
// established there (the server side of a handshake) and those that leave the state (closed
// by either end or reset). One map update per connection event: the sidecar reads the count
// instead of walking every TCP socket of the host with sock_diag each few milliseconds.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "abi.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CONNCOUNT_MAX);
	__type(key, struct conn_port);
	__type(value, struct conn_count);
} CONNCOUNT_MAP SEC(".maps");

static __always_inline struct conn_count *counted(struct bpf_sock_ops *skops)
{
	struct conn_port k = {
		.netns = bpf_get_netns_cookie(skops),
		.port = skops->local_port,
		.zero = 0,
	};
	return bpf_map_lookup_elem(&CONNCOUNT_MAP, &k);
}

SEC("sockops")
int conncount(struct bpf_sock_ops *skops)
{
	struct conn_count *c;
	switch (skops->op) {
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		c = counted(skops);
		if (!c)
			break;
		__sync_fetch_and_add(&c->established, 1);
		__sync_fetch_and_add(&c->changes, 1);
		// Only then is this socket's leaving the state reported to us.
		bpf_sock_ops_cb_flags_set(skops,
					  skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		// args[0] is the old state, args[1] the new one.
		if (skops->args[0] != BPF_TCP_ESTABLISHED || skops->args[1] == BPF_TCP_ESTABLISHED)
			break;
		c = counted(skops);
		if (!c)
			break;
		__sync_fetch_and_add(&c->established, -1);
		__sync_fetch_and_add(&c->changes, 1);
		break;
	}
	return 1;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
