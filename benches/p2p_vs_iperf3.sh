#!/usr/bin/env bash
# Point-to-point latency and bandwidth of ferrogloo between two local processes, next to
# iperf3 on loopback measured in the same run (one way, and per direction with --bidir).
# Usage: benches/p2p_vs_iperf3.sh [runs]   (installs iperf3 with apt-get if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
command -v iperf3 >/dev/null || { apt-get update -qq && apt-get install -y -qq iperf3 >/dev/null; }
cargo build --release --quiet --example pingpong
iperf() { # $@: extra client flags; prints GB/s received per direction
    local port=$((20000 + RANDOM % 20000))
    iperf3 -s -p "$port" >/dev/null 2>&1 &
    local srv=$!
    # Wait (bounded) until the server listens, without connecting to it.
    for _ in $(seq 100); do ss -Hltn "sport = :$port" | grep -q . && break; sleep 0.05; done
    iperf3 -c 127.0.0.1 -p "$port" -t 3 -J "$@" | python3 -c '
import json, sys
e = json.load(sys.stdin)["end"]
rev = e.get("sum_received_bidir_reverse")
print(" ".join(f"{x / 8e9:.2f}" for x in [e["sum_received"]["bits_per_second"]] + ([rev["bits_per_second"]] if rev else [])))'
    kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null || true
}
for r in $(seq "$runs"); do
    echo "run $r"
    ./target/release/examples/pingpong --np 2 --iters 20000 --mib 64 --reps 20 | sed 's/^/  ferrogloo /'
    echo "  iperf3 one way GB/s: $(iperf)"
    echo "  iperf3 --bidir GB/s per direction: $(iperf --bidir)"
done
