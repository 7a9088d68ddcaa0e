"""A request the KV pool cannot hold, and how to read why.

Usage: python rejected.py [ADDR]

Running out of KV blocks is an answer in kvlease, not an exception: the
stream ends with finish reason REJECTED and the cache's figures. This
script reads the pool's size from status(), then starts enough long
generations at once to need about twice the pool. Under max-utilization
with `--on-exhausted reject` (kvlease up --on-exhausted reject) the
requests that cannot grow are rejected mid-stream; under `preempt` they are
recomputed later instead, so the script says so and stops.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

from kvlease import KvleaseClient, KvleaseError


def main(argv):
    addr = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    with KvleaseClient(addr, timeout=300) as client:
        status = client.status()
        if status.policy != "MAX_UTILIZATION" or status.on_exhausted != "reject":
            print(f"the scheduler runs {status.policy} with on_exhausted={status.on_exhausted!r}: "
                  "start it with --policy max-utilization --on-exhausted reject to see rejects")
            return 1
        full = min((p for p in status.pools if p.window == 0), key=lambda p: p.total, default=None)
        if full is None:
            print("the scheduler reports no full-attention pool")
            return 1
        pool_tokens = full.total * full.tokens_per_block
        max_tokens = 256
        requests = 2 * pool_tokens // max_tokens + 1
        print(f"pool {full.pool_id}: {full.total} blocks of {full.tokens_per_block} tokens; "
              f"{requests} requests of up to {max_tokens} tokens at once need about twice that")

        def one(i):
            # ignore_eos: every request wants all its tokens
            return client.complete(f"request {i}: ", max_tokens=max_tokens, ignore_eos=True)

        with ThreadPoolExecutor(max_workers=requests) as pool:
            completions = list(pool.map(one, range(requests)))
    rejected = [c for c in completions if c.finish.rejected]
    for c in rejected[:3]:
        r = c.finish.reject
        print(f"REJECTED after {len(c.tokens)} tokens: {r.reason} in pool {r.pool_id} (window {r.window}): "
              f"needed {r.blocks_needed} blocks, {r.blocks_free} free, {r.blocks_pending_free} pending free "
              f"-- {r.message}")
    served = sum(1 for c in completions if c.finish.reason == "LENGTH")
    print(f"{served} served to their length, {len(rejected)} rejected")
    if not rejected or any(c.finish.reject is None for c in rejected):
        print("expected rejects with the cache's reason and figures")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except KvleaseError as e:
        print(f"call failed: {e}")
        sys.exit(1)
