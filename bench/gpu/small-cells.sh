#!/usr/bin/env bash
# On a GPU machine: is the GPU cells' per-call overhead at small sizes (README, "What ran on a
# GPU") the GPU's time-slicing between the rank processes' contexts? The same cells without and
# with MPS (one shared GPU context), the host cells beside them, then 16-core engine figures.
#
# Prepare here:  ../shared/device/gpu-check && cp bench/gpu/small-cells.sh .gpu/ &&
#                cargo build --release --example engine_bench && cp target/release/examples/engine_bench .gpu/
# Run there, with .gpu carried:  bash .gpu/small-cells.sh     (about 3 minutes)
set -u
cd "$(dirname "$0")"; OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log3.txt") 2>&1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
nvidia-smi --query-gpu=name,compute_mode --format=csv; which nvidia-cuda-mps-control
s=4096,65536,1048576,16777216
b() { timeout 60 ./ferrogloo-bench --np "$1" --device "$2" --op allreduce,allgather,broadcast --sizes "$s" --seconds 0.3 --json "$OUT/$3.jsonl" >/dev/null 2>>/tmp/b.err || tail -3 /tmp/b.err; }
for n in 2 4; do b $n cuda nomps; b $n host host; done; el
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
if nvidia-cuda-mps-control -d; then
  for n in 2 4; do b $n cuda mps; done
  echo quit | nvidia-cuda-mps-control; tail -3 /tmp/mpslog/control.log
fi; el
python3 - "$OUT" <<'PY'
import json, sys, os
rows = {}
for name in ("nomps", "mps", "host"):
    p = os.path.join(sys.argv[1], name + ".jsonl")
    if not os.path.exists(p): continue
    for l in open(p):
        try: r = json.loads(l)
        except ValueError: continue
        k = (r.get("op"), r.get("ranks"), r.get("bytes"))
        rows.setdefault(k, {})[name] = (round(r["p50_us"], 1), round(r["busbw_gbps"], 2))
print("op ranks bytes | p50us busbw: cuda no MPS | cuda MPS | host")
for k in sorted(rows, key=lambda k: (str(k[0]), k[1] or 0, k[2] or 0)):
    print(*k, "|", *(rows[k].get(x, "-") for x in ("nomps", "mps", "host")))
PY
head -c 400 "$OUT/nomps.jsonl"; echo
el; echo "== engine, 16 cores"
for n in 2 4; do timeout 100 ./engine_bench --np $n 2>&1 | grep -v "^{" | tail -14; el; done
