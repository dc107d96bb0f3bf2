"""gloo_bench: Gloo (inside PyTorch's torch.distributed, CPU tensors) timed by ferrogloo-bench's rule.

    python gloo_bench.py --np N --ops allreduce,allgather --sizes 4096,1048576 --seconds 1

Sizes are bytes a call moves (allgather's output, the others' input), f32 elements, sum.
Every call is timed on its own: a barrier, the buffer's reset, a barrier, the call; the
iteration's time is the slowest rank's. Rank 0 prints one JSON row per cell, with the fields
ferrogloo-bench's --json rows have; a collective Gloo does not offer prints a row saying so.
"""

import argparse
import datetime
import json
import os
import queue
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIN_ITERS, MAX_ITERS, WARMUP = 5, 100_000, 3


def plan(op, nbytes, n):
    """Input and output element counts, and the busbw factor (nccl-tests' rule)."""
    count = nbytes // 4
    per = count // n
    if op == "allreduce":
        return count, count, 2 * (n - 1) / n
    if op == "broadcast":
        return count, count, 1.0
    if op == "allgather":
        return per, per * n, (n - 1) / n
    if op == "reduce_scatter":
        return per * n, per, (n - 1) / n
    if op == "alltoall":
        return per * n, per * n, (n - 1) / n
    raise SystemExit(f"gloo_bench: unknown collective {op}")


def call(op, inp, out):
    if op == "allreduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, 0)
    elif op == "allgather":
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    else:
        dist.all_to_all_single(out, inp)


def expected(op, r, n, inp, out):
    total = n * (n + 1) / 2
    if op == "allreduce":
        return bool((inp == total).all())
    if op == "broadcast":
        return bool((inp == 1).all())
    if op == "reduce_scatter":
        return bool((out == total).all())
    blocks = out.view(n, -1) if out.numel() else out.view(n, 0)
    return all(bool((blocks[p] == p + 1).all()) for p in range(n))


def rank_main(r, n, port, args, queue):
    try:
        measure(r, n, port, args, queue)
    finally:
        if r == 0:
            queue.put(None)  # the end, however it came: the parent stops reading


def measure(r, n, port, args, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    for op in args.ops.split(","):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            nin, nout, factor = plan(op, nbytes, n)
            inp, out = torch.empty(nin, dtype=torch.float32), torch.empty(nout, dtype=torch.float32)
            fresh = 0.0 if (op == "broadcast" and r != 0) else float(r + 1)
            try:
                for _ in range(WARMUP):
                    inp.fill_(fresh)
                    call(op, inp, out)
            except (RuntimeError, NotImplementedError) as e:
                if r == 0:
                    queue.put({"impl": "gloo", "op": op, "ranks": n, "bytes": nbytes, "unsupported": str(e)[:200]})
                continue
            times = []
            until = time.perf_counter() + args.seconds
            while True:
                more = torch.tensor([int(len(times) < MAX_ITERS and (len(times) < MIN_ITERS or time.perf_counter() < until))])
                dist.broadcast(more, 0)
                if not more.item():
                    break
                dist.barrier()
                inp.fill_(fresh)
                dist.barrier()
                t = time.perf_counter()
                call(op, inp, out)
                times.append((time.perf_counter() - t) * 1e6)
            wrong = torch.tensor([int(not expected(op, r, n, inp, out))])
            dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
            worst = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if r == 0:
                s = sorted(worst.tolist())
                p50 = s[len(s) // 2]
                moved = max(nin, nout) * 4
                algbw = moved / p50 / 1e3 if p50 > 0 else 0.0
                queue.put({
                    "impl": "gloo", "op": op, "ranks": n, "bytes": moved, "dtype": "f32", "iters": len(s),
                    "p50_us": p50, "min_us": s[0], "p99_us": s[int((len(s) - 1) * 0.99)],
                    "algbw_gbps": algbw, "busbw_gbps": algbw * factor, "wrong": int(wrong.item()),
                    "timing": "per-call-barrier",
                })
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--ops", default="allreduce")
    p.add_argument("--sizes", default="4096,1048576")
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    rows = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.np, port, args, rows)) for r in range(args.np)]
    for proc in procs:
        proc.start()
    # Rows until rank 0 says it has ended; a rank that dies (a peer then waits for it until
    # Gloo's timeout) ends the run at once instead.
    failed = None
    while failed is None:
        try:
            row = rows.get(timeout=0.5)
        except queue.Empty:
            failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
            continue
        if row is None:
            break
        print(json.dumps(row), flush=True)
    for proc in procs:
        proc.join(timeout=0 if failed else 60)
        if proc.is_alive():
            proc.kill()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        print(f"gloo_bench: ranks failed (rank, exit code): {bad}", file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
