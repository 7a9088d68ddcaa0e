#!/usr/bin/env python3
"""A real model end to end on one GPU: kvlease against Hugging Face transformers.

Runs, on the same machine and in one call:

1. a kvlease cluster (cache, one CUDA worker serving the GGUF, scheduler)
   driven by `kvlease bench` at concurrency N: prompts of P tokens (ids drawn
   from the byte range, unique per request, so no prefix is reused), exactly
   M output tokens each (end of sequence ignored), several waves of N;
2. transformers `generate` with a static cache in bf16 at batch N on prompts
   of the same length (ids from the same range), exactly M new tokens, after
   one warm-up call;

and prints both output-token rates, their ratio against the target (>= 2x),
and kvlease's step overhead: from the worker's log, the time between the ends
of two consecutive decode steps minus the compute of the second, over the
compute (target <= 10%).

Needs: the release binaries kvlease, kvlease-cache, kvlease-scheduler and
kvlease-worker (built with `--features cuda`) in --bin-dir; PyTorch,
transformers and the `gguf` package importable (transformers reads the GGUF
through it; `pip install --no-deps --target DIR gguf` and PYTHONPATH=DIR).

    python3 worker-svc/scripts/e2e_vs_transformers.py --bin-dir DIR --gguf FILE
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(kvlease, addr, proc, name, timeout_s=300):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was healthy")
        r = subprocess.run([kvlease, "health", addr], capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"{name} at {addr} not healthy after {timeout_s} s")


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# 2026-12-01T10:16:21.003676Z ... forward done step=863 sequences=7 tokens=7 compute_us=3659
FORWARD_DONE = re.compile(
    r"^(\S+Z) .*forward done step=(\d+) sequences=(\d+) tokens=(\d+) compute_us=(\d+)"
)


def parse_ts(ts):
    # seconds since midnight with microseconds; runs never cross midnight by much
    hms = ts.split("T")[1].rstrip("Z")
    h, m, s = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def step_overhead(worker_log, min_sequences):
    """Decode steps (one token per sequence, at least min_sequences) whose
    predecessor was also a forward: gap = end(i) - end(i-1) - compute(i)."""
    steps = []
    with open(worker_log, errors="replace") as f:
        for line in f:
            m = FORWARD_DONE.search(ANSI.sub("", line))
            if m:
                ts, step, seqs, toks, us = m.groups()
                steps.append((parse_ts(ts), int(step), int(seqs), int(toks), int(us) / 1e6))
    gaps, computes = [], []
    for prev, cur in zip(steps, steps[1:]):
        decode = cur[2] == cur[3] and cur[2] >= min_sequences
        if decode and cur[1] == prev[1] + 1:
            gaps.append(max(0.0, cur[0] - prev[0] - cur[4]))
            computes.append(cur[4])
    return gaps, computes


# ... between forward passes step=12 apply_us=80 settle_us=310 launch_us=40 launched=true
BETWEEN = re.compile(r"between forward passes step=\d+ apply_us=(\d+) settle_us=(\d+) launch_us=(\d+)")


def scheduler_side(scheduler_log):
    """Medians (us) of the scheduler's own work between two forward passes:
    applying the results and streaming them, the Step call to the cache
    (releases, completion, extends), planning and sending the next pass."""
    rows = []
    with open(scheduler_log, errors="replace") as f:
        for line in f:
            m = BETWEEN.search(ANSI.sub("", line))
            if m:
                rows.append(tuple(int(x) for x in m.groups()))
    if not rows:
        return None
    return tuple(statistics.median(r[i] for r in rows) for i in range(3)) + (len(rows),)


def run_kvlease(args, log_dir):
    kv = os.path.join(args.bin_dir, "kvlease")
    ports = {k: free_port() for k in ("scheduler", "cache", "worker")}
    env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
    procs = []

    def start(name, argv):
        log = open(os.path.join(log_dir, f"{name}.log"), "w")
        # the scheduler's debug line per step splits its side of the gap
        own = dict(env, RUST_LOG="info,scheduler_svc::step_loop=debug") if name == "scheduler" else env
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=own)
        procs.append(p)
        return p

    try:
        cache = start("cache", [os.path.join(args.bin_dir, "kvlease-cache"),
                                "--listen", f"127.0.0.1:{ports['cache']}"])
        wait_healthy(kv, f"127.0.0.1:{ports['cache']}", cache, "cache")
        worker = start("worker", [
            os.path.join(args.bin_dir, "kvlease-worker"),
            "--listen", f"127.0.0.1:{ports['worker']}",
            "--model", args.gguf, "--backend", "cuda",
            "--max-batch-sequences", str(args.concurrency),
            "--max-batch-tokens", str(max(4096, args.concurrency * args.prompt_tokens)),
        ])
        wait_healthy(kv, f"127.0.0.1:{ports['worker']}", worker, "worker")
        sched = start("scheduler", [
            os.path.join(args.bin_dir, "kvlease-scheduler"),
            "--listen", f"127.0.0.1:{ports['scheduler']}",
            "--cache-addr", f"http://127.0.0.1:{ports['cache']}",
            "--worker-addrs", f"http://127.0.0.1:{ports['worker']}",
            "--max-seqs", str(args.concurrency),
            "--max-tokens-per-step", str(max(2048, args.concurrency * args.prompt_tokens)),
            "--overlap", "true" if args.overlap else "false",
        ])
        wait_healthy(kv, f"127.0.0.1:{ports['scheduler']}", sched, "scheduler")
        bench = [kv, "bench", "--scheduler", f"127.0.0.1:{ports['scheduler']}",
                 "--requests", str(args.concurrency * args.waves),
                 "--concurrency", str(args.concurrency),
                 "--prefixes", "0", "--prefix-tokens", "0",
                 "--tail-min", str(args.prompt_tokens), "--tail-max", str(args.prompt_tokens),
                 "--output-min", str(args.new_tokens), "--output-max", str(args.new_tokens),
                 "--no-progress", "--fail-on-error"]
        # one warm-up wave (kernels, allocator) on other prompts (another
        # seed), so the measured run reuses no cached prefix; then the
        # measured run
        subprocess.run(bench[:4] + ["--requests", str(args.concurrency)] + bench[6:]
                       + ["--seed", "2"], capture_output=True, text=True, check=True)
        mark = os.path.getsize(os.path.join(log_dir, "worker.log"))
        r = subprocess.run(bench, capture_output=True, text=True)
        print(r.stdout)
        if r.returncode != 0:
            print(r.stderr)
            raise SystemExit("kvlease bench failed")
        m = re.search(r"throughput\s+([\d.]+) req/s, ([\d.]+) output tok/s", r.stdout)
        if not m:
            raise SystemExit("no throughput line in kvlease bench's output")
        # the measured run's part of the worker log
        with open(os.path.join(log_dir, "worker.log"), errors="replace") as f:
            f.seek(mark)
            tail = f.read()
        measured = os.path.join(log_dir, "worker.measured.log")
        with open(measured, "w") as f:
            f.write(tail)
        return (float(m.group(2)), step_overhead(measured, args.concurrency // 2),
                scheduler_side(os.path.join(log_dir, "scheduler.log")))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def run_transformers(args):
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.bfloat16
    ).to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (args.concurrency, args.prompt_tokens), generator=gen).to("cuda")
    mask = torch.ones_like(ids)

    def once():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False,
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
            cache_implementation="static", pad_token_id=0,
        )
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        new = (out.shape[1] - args.prompt_tokens) * out.shape[0]
        return new / elapsed

    once()  # warm-up (static cache allocation, kernels)
    rates = [once() for _ in range(args.repeats)]
    return statistics.median(rates), torch.__version__, __import__("transformers").__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=18)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=4, help="kvlease requests = waves x concurrency")
    ap.add_argument("--repeats", type=int, default=3, help="timed transformers calls (median)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="scheduler overlap mode (next step planned while a forward runs)")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvlease-e2e-")
    os.makedirs(log_dir, exist_ok=True)

    kv_rate, (gaps, computes), sched = run_kvlease(args, log_dir)
    hf_rate, torch_v, tf_v = run_transformers(args)

    ratio = kv_rate / hf_rate
    print(f"SmolLM2 end to end, batch/concurrency {args.concurrency}, {args.prompt_tokens}-token "
          f"prompts, {args.new_tokens} new tokens; torch {torch_v}, transformers {tf_v}")
    print(f"{'system':<44} {'output tok/s':>14}")
    print(f"{'transformers generate (static cache, bf16)':<44} {hf_rate:>14.0f}")
    print(f"{'kvlease bench (cluster, CUDA worker)':<44} {kv_rate:>14.0f}")
    print(f"ratio kvlease / transformers: {ratio:.2f} (target >= 2.00: "
          f"{'met' if ratio >= 2.0 else 'MISSED'})")
    if computes:
        overhead = sum(gaps) / sum(computes)
        print(f"step overhead over {len(computes)} decode steps (>= {args.concurrency // 2} "
              f"sequences): median gap {1e3 * statistics.median(gaps):.3f} ms, median compute "
              f"{1e3 * statistics.median(computes):.3f} ms, total gap / compute {overhead:.3f} "
              f"(target <= 0.10: {'met' if overhead <= 0.10 else 'MISSED'})")
    else:
        print("step overhead: no consecutive decode steps found in the worker's log")
    if sched:
        print(f"scheduler side between forward passes ({sched[3]} steps, all sizes), medians: "
              f"apply + stream {sched[0]:.0f} us, Step call {sched[1]:.0f} us, "
              f"plan + send {sched[2]:.0f} us; the rest of the gap is transport and the "
              f"worker outside its compute")
    print(f"logs: {log_dir}")


if __name__ == "__main__":
    sys.exit(main())
