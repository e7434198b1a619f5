#!/usr/bin/env bash
# A two-proxy rserpool tier on one machine, in network namespaces (docs/TIER.md):
#
#   client ── router (registrar, distributor) ── proxy 1, proxy 2 ── router ── server 1, server 2
#
#   scripts/tier-netns.sh up         # build the namespaces, start everything (root)
#   scripts/tier-netns.sh demo       # an upload through the tier; the proxy carrying it is killed
#   scripts/tier-netns.sh status     # the router's nexthop group and each proxy's tier status
#   scripts/tier-netns.sh restart N  # bring proxy N back (its link, its route, its process)
#   scripts/tier-netns.sh down       # stop everything, remove the namespaces
#
# RSERPOOL=path/to/rserpool picks the binary (default: target/release/rserpool, built if
# missing; `sudo RSERPOOL=… scripts/tier-netns.sh up`, as sudo drops the environment). Logs and
# configuration go to /tmp/rserpool-tier; the proxies pin their eBPF maps on a bpffs of their
# own at /run/rserpool-tier-bpf, which every process started with `ip netns exec` sees (each
# gets a /sys of its own), so that a proxy upgraded in place finds its predecessor's flow table.
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=/tmp/rserpool-tier
BIN=${RSERPOOL:-$PWD/target/release/rserpool}
VIP=10.88.9.1       # the clients' address, on every proxy
SHARED=10.88.9.2    # the server-facing address, on every proxy
ROUTER=10.88.1.1    # the router on the proxies' segment; the registrar listens there
NS=(tier-client tier-router tier-p1 tier-p2 tier-s1 tier-s2)
PINS=/run/rserpool-tier-bpf

need_root() {
	[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces, eBPF)" >&2; exit 1; }
}

start() { # NAMESPACE LOG COMMAND...
	local ns=$1 log=$2
	shift 2
	ip netns exec "$ns" env -u RUST_BACKTRACE "$@" >"$DIR/$log.log" 2>&1 &
	echo $! >>"$DIR/pids"
}

up() {
	need_root
	if [ ! -x "$BIN" ]; then
		cargo build --release -p rserpool
	fi
	if ip netns list | grep -q '^tier-router'; then
		echo "the tier is up already: $0 down first" >&2
		exit 1
	fi
	mkdir -p "$DIR" "$PINS"
	mountpoint -q "$PINS" || mount -t bpf bpf "$PINS"
	: >"$DIR/pids"
	echo "1. namespaces"
	for n in "${NS[@]}"; do
		ip netns add "$n"
		ip -n "$n" link set lo up
	done
	echo "2. the router: forwarding with layer-4 multipath hashing, two bridged segments"
	ip netns exec tier-router sysctl -qw net.ipv4.ip_forward=1
	ip netns exec tier-router sysctl -qw net.ipv4.fib_multipath_hash_policy=1
	ip -n tier-client link add t0 type veth peer name rc netns tier-router
	ip -n tier-client addr add 10.88.0.2/24 dev t0
	ip -n tier-router addr add 10.88.0.1/24 dev rc
	ip -n tier-router link add brp type bridge
	ip -n tier-router addr add $ROUTER/24 dev brp
	ip -n tier-router link add brs type bridge
	ip -n tier-router addr add 10.88.2.1/24 dev brs
	echo "3. proxies on 10.88.1.11 and .12, each with $VIP and $SHARED on its loopback"
	for i in 1 2; do
		ip -n tier-p$i link add t0 type veth peer name rp$i netns tier-router
		ip -n tier-router link set rp$i master brp
		ip -n tier-p$i addr add 10.88.1.1$i/24 dev t0
		ip -n tier-p$i addr add $VIP/32 dev lo
		ip -n tier-p$i addr add $SHARED/32 dev lo
	done
	echo "4. servers on 10.88.2.11 and .12"
	for j in 1 2; do
		ip -n tier-s$j link add t0 type veth peer name rs$j netns tier-router
		ip -n tier-router link set rs$j master brs
		ip -n tier-s$j addr add 10.88.2.1$j/24 dev t0
		# Over veth a packet carries its socket's hash into the router's multipath choice;
		# keep it fixed across retransmissions (on real links the router hashes headers).
		ip netns exec tier-s$j sysctl -qw net.core.txrehash=0
	done
	ip netns exec tier-client sysctl -qw net.core.txrehash=0
	for l in rc brp brs rp1 rp2 rs1 rs2; do ip -n tier-router link set $l up; done
	for n in tier-client tier-p1 tier-p2 tier-s1 tier-s2; do ip -n $n link set t0 up; done
	ip -n tier-client route add default via 10.88.0.1
	for i in 1 2; do ip -n tier-p$i route add default via $ROUTER; done
	for j in 1 2; do ip -n tier-s$j route add default via 10.88.2.1; done

	echo "5. the registrar on the router, and an HTTP pool element on each server"
	start tier-router registrar "$BIN" registrar --asap $ROUTER:3863 --status off
	sleep 0.3
	for j in 1 2; do
		start tier-s$j server$j "$BIN" example http --pool WebPool --id $j \
			--listen 10.88.2.1$j:8080 --registrar $ROUTER:3863
	done

	echo "6. the proxies: a TCP listener on $VIP:7000 handed to the kernel splice, members of ProxyTier"
	for i in 1 2; do
		cat >"$DIR/proxy$i.toml" <<-CONF
			registrars = ["$ROUTER:3863"]
			status = "10.88.1.1$i:8404"
			[[listener]]
			listen = "$VIP:7000"
			mode = "tcp"
			pool = "WebPool"
			splice = "kernel"
			[kernel-splice]
			interfaces = ["t0"]
			pin-dir = "$PINS/p$i"
			[tier]
			pool = "ProxyTier"
			listen = "10.88.1.1$i:9950"
			server-address = "$SHARED"
			ports = "2${i}000-2${i}999"
		CONF
		start_proxy $i
	done

	echo "7. the distributor on the router: nexthop group 100 = the live proxies; $VIP and $SHARED routed to it;"
	echo "   it watches the proxies' traffic on brp (eBPF) to find a dead one within tens of ms"
	start tier-router distributor "$BIN" distributor --pool ProxyTier --registrar $ROUTER:3863 \
		--group 100 --route $VIP/32 --route $SHARED/32 --watch brp
	for _ in $(seq 50); do
		if ip -n tier-router nexthop show id 100 2>/dev/null | grep -q "group [0-9]*,[0-9]*/"; then
			break
		fi
		sleep 0.2
	done
	status
	echo
	echo "Try: ip netns exec tier-client curl -s http://$VIP:7000/hello"
	echo "     $0 demo"
}

start_proxy() { # N
	start tier-p$1 proxy$1 "$BIN" proxy --config "$DIR/proxy$1.toml"
}

# Proxy N back after `demo` (or a kill): its link and default route, then its process.
restart() {
	need_root
	local i=${1:?which proxy: 1 or 2}
	ip -n tier-p$i link set t0 up
	ip -n tier-p$i route replace default via $ROUTER
	for pid in $(ip netns pids tier-p$i); do kill "$pid" 2>/dev/null || true; done
	start_proxy $i
	echo "proxy $i started again (log: $DIR/proxy$i.log)"
}

# The spliced packets proxy N forwarded so far.
packets() {
	ip netns exec tier-p$1 curl -s -m 1 http://10.88.1.1$1:8404/status |
		python3 -c 'import json,sys; print((json.load(sys.stdin).get("kernel_splice") or {}).get("packets", 0))' 2>/dev/null ||
		echo 0
}

status() {
	echo "router: $(ip -n tier-router nexthop show id 100 2>/dev/null || echo 'no group yet')"
	for i in 1 2; do
		printf 'proxy %s: ' $i
		ip netns exec tier-p$i curl -s -m 1 http://10.88.1.1$i:8404/status |
			python3 -c 'import json,sys; s=json.load(sys.stdin); t=s.get("tier") or {}; k=s.get("kernel_splice") or {}; print("member", t.get("member"), "links", t.get("links"), "splices received", t.get("splices_received"), "handed over", k.get("handed_over"), "entries", k.get("entries"))' 2>/dev/null ||
			echo "not answering"
	done
}

demo() {
	need_root
	local f=$DIR/upload.bin
	head -c 20000000 /dev/urandom >"$f"
	echo "uploading 20 MB at 5 MB/s through the tier; the proxy carrying it is killed after 2 s"
	ip netns exec tier-client curl -s -H "Expect:" --limit-rate 5M -T "$f" http://$VIP:7000/upload &
	local up=$!
	sleep 1.5
	local a1 a2 b1 b2 victim
	a1=$(packets 1) a2=$(packets 2)
	sleep 0.5
	b1=$(packets 1) b2=$(packets 2)
	# The router hashes each direction of the upload to a proxy (the same one or not): the
	# proxy that forwarded more of its packets carries it.
	if [ $((b2 - a2)) -gt $((b1 - a1)) ]; then victim=2; else victim=1; fi
	echo "the upload goes through proxy $victim (spliced packets forwarded in 0.5 s: proxy 1 $((b1 - a1)), proxy 2 $((b2 - a2)))"
	local pid
	pid=$(ip netns pids tier-p$victim | head -1)
	[ -n "$pid" ] && kill -9 "$pid" && ip -n tier-p$victim link set t0 down && echo "proxy $victim killed, its link down"
	wait $up
	echo "the server's hash of what it received is above; the file's is $(python3 -c "
import sys
h = 0xcbf29ce484222325
for b in open(sys.argv[1], 'rb').read():
    h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
print(f'{h:016x}')" "$f")"
	echo "bring proxy $victim back: $0 restart $victim"
}

down() {
	need_root
	if [ -f "$DIR/pids" ]; then
		xargs -r kill <"$DIR/pids" 2>/dev/null || true
	fi
	for n in "${NS[@]}"; do
		for pid in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
		ip netns del "$n" 2>/dev/null || true
	done
	if mountpoint -q "$PINS"; then umount "$PINS"; fi
	rm -rf "$PINS" "$DIR"
	echo "down"
}

case "${1:-}" in
up) up ;;
demo) demo ;;
status) status ;;
restart) restart "${2:-}" ;;
down) down ;;
*)
	sed -n '2,16p' "$0"
	exit 2
	;;
esac
