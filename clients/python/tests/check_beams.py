"""Beam search over gRPC against an independent one.

Usage: python check_beams.py SCHEDULER GGUF   (host:port; the served model's file)

The kvlease client asks `beam_width=4, n=4` for token-id prompts; a beam
search written here from the rule the scheduler documents (transformers'
`num_beams` with length penalty 1.0 and `early_stopping=False`, over the raw
log-softmax) runs over the numpy forward pass of `clients/openai/reference.py`
(f32, sharing no code with kvlease). Every rank must hold the same tokens,
end the same way, and carry a cumulative logprob within 1e-3 of the
reference's. Needs numpy and gguf (clients-test's venv has both).
"""

import os
import sys
import time

import numpy as np
from gguf import GGUFReader

from kvlease import KvleaseClient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "openai"))
from reference import Llama, log_softmax  # noqa: E402

WIDTH = 4
MAX_TOKENS = 8
PROMPTS = [
    ["The", " capital", " of", " France", " is"],
    ["Once", " upon", " a", " time", ",", " there", " was", " a"],
    ["The", " best", " way", " to", " learn", " is"],
]


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)
    print(f"ok: {what}")


def score(logprob, length):
    return logprob / max(length, 1)


class Hypotheses:
    """The best `width` finished hypotheses: (tokens, logprob, stopped)."""

    def __init__(self, width):
        self.width = width
        self.kept = []

    def worst(self):
        # the worst score; of equals, the latest kept
        return min(range(len(self.kept)), key=lambda i: (score(self.kept[i][1], len(self.kept[i][0])), -i))

    def add(self, tokens, logprob, stopped):
        h = (tokens, logprob, stopped)
        if len(self.kept) < self.width or score(logprob, len(tokens)) > self.worst_score():
            self.kept.append(h)
            if len(self.kept) > self.width:
                del self.kept[self.worst()]

    def worst_score(self):
        if not self.kept:
            return -np.inf
        w = self.kept[self.worst()]
        return score(w[1], len(w[0]))

    def done(self, best_live):
        if best_live is None:
            return True
        return len(self.kept) >= self.width and self.worst_score() >= score(best_live[1], len(best_live[0]))

    def ranked(self):
        # a stable sort keeps the order of equals
        return sorted(self.kept, key=lambda h: -score(h[1], len(h[0])))


def beam_search(model, prompt, width, max_tokens, stop):
    live = [((), 0.0)]
    hyps = Hypotheses(width)
    while True:
        cands = []
        for b, (gen, lp) in enumerate(live):
            row = log_softmax(model.logits(list(prompt) + list(gen))[-1])
            # the row's 2 * width most likely tokens (ties: the lower id)
            top = [int(t) for t in np.lexsort((np.arange(len(row)), -row))[: 2 * width]]
            cands.extend((lp + float(row[t]), b, t) for t in top)
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        next_live, ended_at_length = [], 0
        for rank, (lp, b, t) in enumerate(cands[: 2 * width]):
            if len(next_live) + ended_at_length >= width:
                break
            gen = live[b][0] + (t,)
            if t in stop:
                if rank < width:
                    hyps.add(gen, lp, True)
                continue
            if len(gen) >= max_tokens:
                hyps.add(gen, lp, False)
                ended_at_length += 1
            else:
                next_live.append((gen, lp))
        live = next_live
        if hyps.done(live[0] if live else None):
            return hyps.ranked()


def main(addr, gguf_path):
    started = time.monotonic()
    model = Llama(gguf_path)
    # the file's end token: both searches stop on it and on nothing else
    stop = [int(GGUFReader(gguf_path).fields["tokenizer.ggml.eos_token_id"].contents())]
    with KvleaseClient(addr, timeout=300) as client:
        for words in PROMPTS:
            prompt = [model.token_id(w) for w in words]
            # ignore_eos with the end id named: both searches stop on exactly `stop`
            got = client.generate(tokens=prompt, max_tokens=MAX_TOKENS, beam_width=WIDTH, n=WIDTH,
                                  ignore_eos=True, stop_tokens=stop).results()
            want = beam_search(model, prompt, WIDTH, MAX_TOKENS, stop)
            text = "".join(words)
            check(len(got) == len(want) == WIDTH, f"{text!r}: {len(got)} hypotheses over gRPC, "
                                                  f"{len(want)} from the reference search")
            for rank, (g, (tokens, lp, stopped)) in enumerate(zip(got, want)):
                reason = "STOP" if stopped else "LENGTH"
                check(tuple(g.tokens) == tuple(tokens) and g.finish.reason == reason
                      and abs(g.finish.cumulative_logprob - lp) <= 1e-3,
                      f"{text!r} rank {rank}: {list(g.tokens)} {g.finish.reason} "
                      f"{g.finish.cumulative_logprob:.5f} == reference {list(tokens)} {reason} {lp:.5f}")
    print(f"beam search reference check passed in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(64)
    main(sys.argv[1], sys.argv[2])
