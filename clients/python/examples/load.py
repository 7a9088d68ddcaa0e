"""A small concurrent load: N requests, C at a time; prints how they ended,
time to first token and throughput.

Usage: python load.py [ADDR] [--requests N] [--concurrency C] [--max-tokens T]
Exits 1 when any call fails (a reject is an answer, counted by reason).
"""

import argparse
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kvlease import KvleaseClient, KvleaseError

PREFIXES = [
    "The paged KV cache lends its blocks to each request in turn. ",
    "A scheduler batches requests continuously and leases their blocks. ",
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("addr", nargs="?", default="127.0.0.1:50051")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()

    with KvleaseClient(a.addr, timeout=300) as client:
        def one(i):
            start = time.perf_counter()
            first = None
            tokens = 0
            # shared prefixes, so later requests reuse cached blocks
            generation = client.generate(PREFIXES[i % len(PREFIXES)] + f"Request {i}.", max_tokens=a.max_tokens)
            for chunk in generation:
                if first is None:
                    first = time.perf_counter() - start
                tokens += len(chunk.tokens)
            return generation.finish, first, tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=a.concurrency) as pool:
            results = list(pool.map(one, range(a.requests)))
        elapsed = time.perf_counter() - start

    reasons = Counter(f.reason for f, _, _ in results)
    ttfts = [t for _, t, _ in results if t is not None]
    tokens = sum(n for _, _, n in results)
    reused = sum(f.reused_tokens for f, _, _ in results)
    prompt = sum(f.prompt_tokens for f, _, _ in results)
    print(f"{a.requests} requests, {a.concurrency} at a time, in {elapsed:.2f} s: {dict(reasons)}")
    if ttfts:
        print(f"TTFT p50 {statistics.median(ttfts) * 1000:.1f} ms, max {max(ttfts) * 1000:.1f} ms; "
              f"{tokens} tokens out, {tokens / elapsed:.1f} tokens/s; "
              f"{reused} of {prompt} prompt tokens from the prefix cache")
    return 0 if tokens > 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KvleaseError as e:
        print(f"call failed: {e}")
        sys.exit(1)
