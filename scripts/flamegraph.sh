#!/usr/bin/env bash
# A flame graph of a running process (docs/PERFORMANCE.md): perf samples with call graphs
# (DWARF unwinding: the release build keeps its debug information), folded and drawn by
# inferno.
#
#   scripts/flamegraph.sh PID SECONDS OUT.svg [TITLE]
#
# Needs root or perf_event_paranoid ≤ 1, perf (apt-get install -y linux-perf) and inferno
# (cargo install inferno).
set -euo pipefail

[ $# -ge 3 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
pid=$1 secs=$2 out=$3
title=${4:-$(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-100)}
for tool in perf inferno-collapse-perf inferno-flamegraph; do
	command -v "$tool" >/dev/null || { echo "$tool not found (see the header of $0)" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
perf record -q -F 499 --call-graph dwarf,16384 -p "$pid" -o "$tmp/perf.data" -- sleep "$secs"
perf script -i "$tmp/perf.data" 2>/dev/null | inferno-collapse-perf > "$tmp/folded"
inferno-flamegraph --title "$title" --countname "ns of CPU" --minwidth 0.3 < "$tmp/folded" > "$out"
echo "$out: $(wc -l < "$tmp/folded") distinct stacks"
