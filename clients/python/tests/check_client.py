"""The kvlease Python client against a running scheduler.

Usage: python check_client.py ADDR   (the scheduler, host:port)

Each check prints ok or FAIL and the script exits 1 on the first failure.
Works with any model: it compares the client's views of one request with
each other and with the scheduler's own counters, never with fixed text.
"""

import sys

from kvlease import KvleaseClient, KvleaseError

PROMPT = "The paged KV cache lends its blocks to each request in turn. "


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)
    print(f"ok: {what}")


def raises(fn, exc):
    try:
        fn()
    except exc as e:
        return e
    return None


def main(addr):
    with KvleaseClient(addr, timeout=120) as client:
        check(client.health(), "health() of the whole server is SERVING")
        check(client.health("kvlease.v1.Scheduler"), "health('kvlease.v1.Scheduler') is SERVING")
        e = raises(lambda: client.health("kvlease.v1.Nope"), KvleaseError)
        check(e is not None and e.code == "NOT_FOUND", f"health of an unknown service is NOT_FOUND: {e}")

        before = client.status()
        check(before.policy in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")
              and before.pools and all(p.total > 0 for p in before.pools),
              f"status(): {before.policy}, {len(before.pools)} pool(s) of {[p.total for p in before.pools]} blocks")

        generation = client.generate(PROMPT, max_tokens=8)
        chunks = list(generation)
        f = generation.finish
        streamed = "".join(c.text for c in chunks)
        tokens = [t for c in chunks for t in c.tokens]
        check(f is not None and f.reason in ("LENGTH", "STOP") and 0 < len(tokens) <= 8,
              f"generate() streams {len(chunks)} chunks, {len(tokens)} tokens, then {f.reason if f else None}")
        check(f.prompt_tokens > 0, f"the finish carries the prompt's {f.prompt_tokens} tokens")

        whole = client.complete(PROMPT, max_tokens=8)
        check(whole.text == streamed and list(whole.tokens) == tokens,
              f"complete() (greedy) gives the streamed text again: {whole.text!r}")
        check(whole.finish.reused_tokens > 0,
              f"the second request reuses the first one's cached prefix: {whole.finish.reused_tokens} tokens")

        by_ids = client.complete(tokens=tokens[:4], max_tokens=2)
        check(by_ids.finish.prompt_tokens == 4 and len(by_ids.tokens) >= 1,
              f"a token-id prompt: {by_ids.finish.prompt_tokens} prompt tokens, {len(by_ids.tokens)} out")

        banned = tokens[0]
        biased = client.complete(PROMPT, max_tokens=8, logit_bias={banned: -100.0})
        check(banned not in biased.tokens,
              f"logit_bias -100 bans greedy's first token {banned}: {list(biased.tokens)}")
        e = raises(lambda: client.complete(PROMPT, max_tokens=2, min_p=1.5), KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "min_p" in e.details,
              f"min_p 1.5 is INVALID_ARGUMENT naming it: {e}")
        scored = client.complete(PROMPT, max_tokens=8, logprobs=3, prompt_logprobs=True, echo=True)
        check(list(scored.tokens) == tokens and len(scored.logprobs) == len(tokens)
              and all(l.token == t and l.logprob <= 0 and len(l.top) == 3 and l.top[0].token == t
                      for l, t in zip(scored.logprobs, tokens)),
              f"logprobs=3: each greedy token first among 3 alternatives, logprobs "
              f"{[round(l.logprob, 3) for l in scored.logprobs]}")
        p = scored.finish.prompt_logprobs
        check(len(p) == scored.finish.prompt_tokens and p[0].logprob is None
              and all(l.logprob is not None and l.logprob <= 0 for l in p[1:]),
              f"prompt_logprobs: {len(p)} prompt tokens, the first without a logprob")
        check(scored.finish.prompt_text == PROMPT, f"echo: the prompt's text {scored.finish.prompt_text!r}")
        e = raises(lambda: client.complete(PROMPT, max_tokens=2, logprobs=21), KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "logprobs.top" in e.details,
              f"logprobs=21 is INVALID_ARGUMENT naming logprobs.top: {e}")
        samples = client.generate(PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3).results()
        texts = [c.text for c in samples]
        check(len(samples) == 3 and len(set(texts)) > 1 and all(c.finish.reason in ("LENGTH", "STOP") for c in samples),
              f"n=3 with a seed: three samples, not all the same: {texts!r}")
        one = client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=5)
        check(one.text == texts[0], "sample 0 keeps the seed: it is the one-sample completion")
        e = raises(lambda: client.generate(PROMPT, max_tokens=2, n=17).results(), KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "n" in e.details,
              f"n=17 is INVALID_ARGUMENT naming n: {e}")
        beams = client.generate(PROMPT, max_tokens=8, beam_width=4, n=2).results()
        check(len(beams) == 2 and all(b.finish.cumulative_logprob is not None for b in beams)
              and beams == client.generate(PROMPT, max_tokens=8, beam_width=4, n=2).results(),
              f"beam_width=4, n=2: two ranked hypotheses with their logprobs, deterministic: {beams!r}")
        e = raises(lambda: client.generate(PROMPT, max_tokens=2, beam_width=4, temperature=0.5).results(),
                   KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "temperature" in e.details,
              f"temperature with beams is INVALID_ARGUMENT naming temperature: {e}")
        kept = client.complete(PROMPT, max_tokens=2, retain={"tokens": 4, "priority": 10, "ttl_s": 60})
        check(kept.finish.reason in ("LENGTH", "STOP"), f"a retention hint is taken: {kept.finish.reason}")

        e = raises(lambda: client.complete(PROMPT, max_tokens=0), KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "max_tokens" in e.details,
              f"max_tokens=0 is INVALID_ARGUMENT with the reason: {e}")
        e = raises(lambda: client.complete(PROMPT, max_tokens=10_000_000), KvleaseError)
        check(e is not None and e.code == "INVALID_ARGUMENT" and "context limit" in e.details,
              f"a max_tokens past the context is INVALID_ARGUMENT: {e}")
        e = raises(lambda: client.generate(PROMPT, tokens=[1]), ValueError)
        check(e is not None, f"text and tokens together are refused before sending: {e}")

        long = client.generate(PROMPT, max_tokens=512, ignore_eos=True)
        first = next(long)
        long.cancel()
        rest = list(long)
        check(len(first.tokens) > 0 and long.finish is not None and long.finish.reason == "CANCELLED",
              f"cancel() after the first chunk ends the stream CANCELLED, {len(rest)} chunks after it,"
              f" no exception: {long.finish}")

        after = client.status()
        check(after.finished_length + after.finished_stop >= before.finished_length + before.finished_stop + 3,
              f"status() counted the finished requests: {before.finished_length + before.finished_stop} -> "
              f"{after.finished_length + after.finished_stop}")
    print("python client check passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
