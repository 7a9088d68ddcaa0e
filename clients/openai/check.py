"""The official `openai` package against a running `kvlease up --http-listen`.

Usage: python check.py [--rejects] BASE_URL (e.g. http://127.0.0.1:8000/v1)
       python check.py --factual BASE_URL [CACHE_ADDR]   (a real chat model, e.g. kvlease up --model smollm2)
       python check.py --reference BASE_URL GGUF   (the served model's GGUF file; needs numpy and gguf)

Checks, each failing with a message and exit code 1:
- models.list names the served model;
- a completion, whole and streamed (greedy, so both give the same text), with
  usage (prompt, completion and cached tokens; the second request reuses the
  first one's cached prefix);
- a chat completion, whole and streamed, when the model has a chat template;
  with the seeded model (no template) the refusal is an openai.BadRequestError
  saying so;
- a request that cannot fit surfaces as openai.BadRequestError (HTTP 400)
  whose message names the limit;
- with --rejects (a cluster started with --on-exhausted reject and a small
  pool): a burst of long completions over-subscribes the pool, and the
  requests the cache refuses surface as openai.RateLimitError (HTTP 429)
  whose message carries the reject reason and the cache's figures, while the
  others are served to their length.

With --factual: a chat completion, whole and streamed, answers "What is the
capital of France?" with an answer that names Paris; a logit_bias of +100
makes one token every token, one of -100 bans a token the greedy
completion repeats, a prompt sent as token ids gives the text of the same
prompt sent as text and a stop string ends it, stop_token_ids end it at
that token, top_p 1e-6 is greedy, min_tokens holds the end token back,
frequency, presence and repetition penalties reduce the
repeats of a repetitive prompt, top_k 1 at temperature 1 is greedy, and
min_p 2 is a 400 naming min_p; n=3 with a seed gives three different
completions, the same three again, streamed with each chunk's index and
usage counting the prompt once, and (given the cache's gRPC address) the
cache's figures show the prompt's blocks leased once: the two forked
choices took (prompt - 1) // tokens_per_block full blocks each by reference
and a copy of the block of the last prompt token; n=17 is a 400 naming n; logprobs: a greedy completion with
logprobs=5 lists each chosen token first among at most 6 alternatives whose
probabilities sum to at most 1 (streamed, the same values); echo puts the
prompt's text first and its logprobs (the first null); chat's logprobs with
top_logprobs 5 give each token's bytes and 5 sorted alternatives; logprobs
6 and top_logprobs 21 are 400s naming the field.

With --reference: the logprobs equal an independent reference within 1e-3,
a Llama forward pass in numpy over the same GGUF file (reference.py, f32):
a greedy completion with echo and logprobs=5 (every prompt token after the
first and every generated token: the chosen token's logprob and each
alternative's; the greedy token the reference's most likely; the
alternatives' probabilities sum to at most 1), a sampled one (temperature
1.3, seeded: the logprobs are of the raw distribution, whatever the
temperature), and one under a regex grammar (kvlease's extension; the
logprobs are of the raw distribution, before the grammar's mask: the text
follows the regex while a likelier raw token the grammar refuses stays
listed).
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import openai

MODEL = "kvlease"
PROMPT = "The paged KV cache lends its blocks to each request in turn. "


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)
    print(f"ok: {what}")


def main(base_url):
    # no retries: a 429 or 503 must show here, not be hidden by backoff
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    ids = [m.id for m in client.models.list().data]
    check(ids == [MODEL], f"models.list gives {ids}")

    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    check(choice.finish_reason == "length", f"completion finish_reason {choice.finish_reason!r}")
    u = whole.usage
    check(u.prompt_tokens == len(PROMPT.encode()) and u.completion_tokens == 8
          and u.total_tokens == u.prompt_tokens + 8,
          f"completion usage {u.prompt_tokens} + {u.completion_tokens} = {u.total_tokens}")

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    check(text == choice.text, f"streamed completion equals the whole one: {text!r}")
    usage = chunks[-1].usage
    check(usage is not None and usage.completion_tokens == 8, "the streamed usage chunk")
    cached = usage.prompt_tokens_details.cached_tokens
    check(cached > 0, f"the second request reuses the cached prefix: {cached} cached tokens")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    except openai.BadRequestError as e:
        check("no chat template" in e.message, f"chat without a template is a 400: {e.message}")
    else:
        answer = chat.choices[0].message.content
        check(chat.choices[0].finish_reason in ("stop", "length"), f"chat answers {answer!r}")
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        check(streamed == answer, f"streamed chat equals the whole one: {streamed!r}")

    try:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "max_tokens 100000 exceeds the context limit" in e.message
              and getattr(e, "param", None) == "max_tokens",
              f"a request that cannot fit is an openai.BadRequestError naming max_tokens: "
              f"{e.message} (param {getattr(e, 'param', None)!r})")
    else:
        check(False, "a request that cannot fit was served")

    try:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    except openai.NotFoundError as e:
        check(e.code == "model_not_found", f"an unknown model is a 404: {e.message}")
    else:
        check(False, "an unknown model was served")
    print("openai package check passed")


def rejects(base_url, requests=48, max_tokens=256):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    def one(i):
        try:
            r = client.completions.create(model=MODEL, prompt=f"request {i}: ", max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason
        except openai.RateLimitError as e:
            return e

    with ThreadPoolExecutor(max_workers=requests) as pool:
        outcomes = list(pool.map(one, range(requests)))
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    served = [o for o in outcomes if o == "length"]
    print(f"{requests} completions of {max_tokens} tokens at once: {len(served)} served, "
          f"{len(refused)} refused")
    odd = [o for o in outcomes if o != "length" and not isinstance(o, openai.RateLimitError)]
    check(not odd, f"every request served to its length or refused ({len(odd)} other ends: {odd})")
    check(refused, "an over-subscribed pool refuses some requests")
    e = refused[0]
    check(e.status_code == 429 and "POOL_EXHAUSTED" in e.message and "blocks needed" in e.message,
          f"a refused request is an openai.RateLimitError naming the reason and figures: {e.message}")
    print("openai reject check passed")


def factual(base_url, cache_addr=None):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    # a real model is served under its own name: ask for it, as a client would
    model = client.models.list().data[0].id
    print(f"served model: {model!r}")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    answer = chat.choices[0].message.content
    print(f"Q: {messages[0]['content']}\nA: {answer}")
    check("Paris" in answer, f"the chat answer names Paris ({chat.choices[0].finish_reason}, "
                             f"{chat.usage.prompt_tokens} prompt + {chat.usage.completion_tokens} completion tokens)")
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(streamed == answer, "the streamed chat gives the same answer")

    # sampling fields through the openai package (extra_body for vLLM's)
    def complete(prompt, temperature=0, **kw):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=temperature, **kw)
        return r.choices[0].text
    forced = complete("The capital of France is", logit_bias={"1000": 100})
    piece = forced[:len(forced) // 16]
    check(piece and forced == piece * 16,
          f"logit_bias +100 on token 1000 makes it every one of 16 tokens: {forced!r}")
    # a logit_bias of -100 bans a token: a prompt token that the greedy
    # completion repeats (echo names the prompt's ids' texts), banned
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
    def tokens_of(**kw):
        r = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                      logprobs=1, echo=True, **kw)
        t = r.choices[0].logprobs.tokens
        return t[:len(ids)], t[len(ids):]
    named, free = tokens_of()
    repeated = [(i, t) for i, t in zip(ids, named) if t in free]
    check(repeated, f"the greedy completion repeats a prompt token: {named} -> {free}")
    ban, text = repeated[0]
    _, banned = tokens_of(logit_bias={str(ban): -100})
    check(text not in banned, f"logit_bias -100 bans token {ban} ({text!r}): {free.count(text)} of 16 "
                              f"greedy tokens without the ban, none with it ({banned})")
    # a prompt sent as token ids comes back with its text, and stop strings apply
    as_text = complete("The capital of France is")
    as_ids = complete(ids)
    check(as_ids and as_ids == as_text, f"a token-id prompt gives the text of the same prompt as text: {as_ids!r}")
    stop = as_ids[len(as_ids) // 2:len(as_ids) // 2 + 3]
    r = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    cut = as_ids[:as_ids.index(stop)]
    check(r.choices[0].text == cut and r.choices[0].finish_reason == "stop",
          f"a stop string on a token-id prompt ends the text before it: {stop!r} -> {r.choices[0].text!r}")
    # stop_token_ids (vLLM's): the repeated prompt token ends the greedy
    # completion there; its text stays in the output (a token that is not
    # special, as vLLM documents)
    r = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ban]})
    upto = as_ids[:as_ids.index(text) + len(text)]
    check(r.choices[0].finish_reason == "stop" and r.choices[0].text == upto,
          f"stop_token_ids [{ban}] ends the completion at {text!r}: {r.choices[0].text!r}")
    # top_p that keeps only the most likely token is greedy at any temperature
    nucleus = complete("The capital of France is", temperature=1.5, seed=11, top_p=1e-6)
    check(nucleus == as_text, f"top_p 1e-6 at temperature 1.5 is greedy: {nucleus!r}")
    # min_tokens (vLLM's) holds the end token back: the chat answer goes on
    short = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    longer = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                            extra_body={"min_tokens": short.usage.completion_tokens + 4})
    check(short.choices[0].finish_reason == "stop"
          and longer.usage.completion_tokens >= short.usage.completion_tokens + 4,
          f"min_tokens {short.usage.completion_tokens + 4}: {longer.usage.completion_tokens} tokens, "
          f"{short.usage.completion_tokens} without it")
    plain = complete("1, 1, 1, 1, 1, 1, 1, 1,")
    penalised = complete("1, 1, 1, 1, 1, 1, 1, 1,", frequency_penalty=2.0, presence_penalty=2.0)
    check(penalised != plain and penalised.count("1") < plain.count("1"),
          f"penalties reduce the repeats: {plain.count('1')} ones greedy ({plain!r}), "
          f"{penalised.count('1')} penalised ({penalised!r})")
    repeated = complete("1, 1, 1, 1, 1, 1, 1, 1,", extra_body={"repetition_penalty": 2.0})
    check(repeated.count("1") < plain.count("1"),
          f"repetition_penalty 2 reduces the repeats: {repeated.count('1')} ones ({repeated!r})")
    topk1 = complete("The capital of France is", temperature=1.0, seed=7, extra_body={"top_k": 1})
    check(topk1 == complete("The capital of France is"), f"top_k 1 at temperature 1 is greedy: {topk1!r}")
    try:
        complete("x", extra_body={"min_p": 2})
        check(False, "min_p 2 was served")
    except openai.BadRequestError as e:
        check("min_p" in e.message, f"min_p 2 is a 400 naming it: {e.message}")
    samples(client, model, cache_addr)
    logprobs(client, model)
    print("openai factual chat check passed")


def fork_figures(cache_addr):
    """(fork_shared, fork_copies, tokens_per_block) summed over the cache's pools."""
    import grpc
    from kvlease.v1 import cache_pb2, cache_pb2_grpc

    with grpc.insecure_channel(cache_addr) as channel:
        pools = cache_pb2_grpc.CacheServiceStub(channel).GetStats(cache_pb2.GetStatsRequest()).pools
    return (sum(p.fork_shared for p in pools), sum(p.fork_copies for p in pools),
            pools[0].tokens_per_block, len(pools))


def samples(client, model, cache_addr):
    # past two blocks of 16 tokens, so that the forks share full blocks
    prompt = ("The harbour at dusk: gulls above the grey water, salt on the rocks, the wind in the ropes, "
              "and the boats coming home one by one. Write a one-line poem about it:")
    before = fork_figures(cache_addr) if cache_addr else None

    def create(**kw):
        return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=1.0, seed=5,
                                         extra_body={"ignore_eos": True}, **kw)
    many = create(n=3)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    check([c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1, 2]
          and len(set(texts)) == 3, f"n=3 with a seed gives three different completions: {texts!r}")
    one = create()
    check(many.usage.prompt_tokens == one.usage.prompt_tokens
          and many.usage.completion_tokens == 3 * 16,
          f"usage counts the prompt once ({many.usage.prompt_tokens} tokens) and every choice's tokens "
          f"({many.usage.completion_tokens})")
    check(one.choices[0].text == texts[0], "choice 0 keeps the seed: it is the one-choice completion")
    if before is not None:
        after = fork_figures(cache_addr)
        shared, copies, b, pools = after[0] - before[0], after[1] - before[1], after[2], after[3]
        p = many.usage.prompt_tokens
        want = (2 * ((p - 1) // b) * pools, 2 * pools if (p - 1) % b else 0)
        check((shared, copies) == want and shared > 0,
              f"the prompt's blocks were leased once: the 2 forks shared {shared} blocks and copied {copies} "
              f"(a {p}-token prompt in blocks of {b}: {want})")
    again = create(n=3)
    check([c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts,
          "the same three completions again")
    streamed = ["", "", ""]
    for chunk in create(n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    check(streamed == texts, "streamed, each chunk names its choice: the same three texts")
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, n=17)
        check(False, "n=17 was served")
    except openai.BadRequestError as e:
        check(getattr(e, "param", None) == "n", f"n=17 is a 400 naming n: {e.message}")


def logprobs(client, model):
    import math

    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8,
          f"completions logprobs=5: one entry per token ({len(lp.tokens)})")
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        mass = sum(math.exp(v) for v in top.values())
        check(len(top) <= 6 and mass <= 1 + 1e-6 and chosen <= 0,
              f"token {token!r}: logprob {chosen:.4f}, {len(top)} alternatives, mass {mass:.4f} <= 1")
        check(top.get(token) == chosen and chosen == max(top.values()),
              f"greedy: {token!r} is the most likely of its alternatives")
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                            logprobs=5, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    check(streamed == lp.token_logprobs, "streamed logprobs equal the whole answer's")

    echo = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                     logprobs=1)
    text = echo.choices[0].text
    elp = echo.choices[0].logprobs
    n = echo.usage.prompt_tokens + 4
    check(text.startswith(prompt) and len(text) > len(prompt), f"echo puts the prompt first: {text!r}")
    check(len(elp.tokens) == n and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
          and all(v is not None and v <= 0 for v in elp.token_logprobs[1:]),
          f"echo with logprobs: the prompt's {echo.usage.prompt_tokens} tokens first, the first null")
    check(elp.token_logprobs[-4:] == lp.token_logprobs[:4], "the echoed answer's own logprobs are the plain one's")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    check(len(content) == chat.usage.completion_tokens, f"chat logprobs: {len(content)} tokens")
    for e in content:
        alts = [t.logprob for t in e.top_logprobs]
        check(len(alts) == 5 and alts == sorted(alts, reverse=True)
              and sum(math.exp(v) for v in alts) <= 1 + 1e-6 and e.top_logprobs[0].token == e.token,
              f"chat token {e.token!r} ({e.logprob:.4f}, bytes {e.bytes}): 5 sorted alternatives, it first")
    for kw, param in ((dict(logprobs=6), "logprobs"),):
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=1, **kw)
            check(False, f"{kw} was served")
        except openai.BadRequestError as e:
            check(getattr(e, "param", None) == param, f"{kw} is a 400 naming {param}: {e.message}")
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=1, logprobs=True,
                                       top_logprobs=21)
        check(False, "top_logprobs 21 was served")
    except openai.BadRequestError as e:
        check(getattr(e, "param", None) == "top_logprobs", f"top_logprobs 21 is a 400 naming it: {e.message}")


def reference_logprobs(base_url, gguf_path):
    import math
    import re
    import time

    from reference import Llama, log_softmax

    started = time.monotonic()
    ref = Llama(gguf_path)
    print(f"reference: {gguf_path} read in {time.monotonic() - started:.1f} s")
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    within = 1e-3

    def compare(what, greedy=False, max_tokens=6, **kw):
        """Asks for a completion with the prompt echoed and logprobs=5 and
        compares every token's logprobs with the reference's; returns the
        choice and how many of its generated tokens were not the
        reference's most likely."""
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=5,
                                      **kw)
        lp = r.choices[0].logprobs
        n_prompt = r.usage.prompt_tokens
        check(len(lp.tokens) == n_prompt + r.usage.completion_tokens and lp.token_logprobs[0] is None,
              f"{what}: the prompt's {n_prompt} tokens and the {r.usage.completion_tokens} generated ones")
        ids = [ref.token_id(t) for t in lp.tokens]
        rows = ref.logits(ids[:-1])
        worst, not_argmax = 0.0, 0
        for i in range(1, len(ids)):
            want = log_softmax(rows[i - 1])
            top = lp.top_logprobs[i]
            mass = sum(math.exp(v) for v in top.values())
            diffs = [abs(lp.token_logprobs[i] - want[ids[i]])]
            diffs += [abs(v - want[ref.token_id(t)]) for t, v in top.items()]
            worst = max(worst, *diffs)
            if max(diffs) > within or len(top) > 6 or mass > 1 + 1e-6:
                check(False, f"{what}: token {i} {lp.tokens[i]!r}: logprob {lp.token_logprobs[i]:.6f}, "
                             f"reference {want[ids[i]]:.6f}; alternatives {top} (mass {mass:.6f})")
            if i >= n_prompt and want[ids[i]] < want.max() - within:
                not_argmax += 1
                if greedy:
                    check(False, f"{what}: greedy token {i} {lp.tokens[i]!r} ({want[ids[i]]:.6f}) is not the "
                                 f"reference's most likely ({want.max():.6f})")
        check(True, f"{what}: {len(ids) - 1} tokens' logprobs and their alternatives within {worst:.1e} of the "
                    f"reference's (<= {within}), each position's mass <= 1")
        return r.choices[0], not_argmax

    compare("greedy completion", greedy=True, temperature=0)
    compare("sampled completion", temperature=1.3, seed=7)
    pattern = "(yes|no), [0-9]{2,4}!"
    choice, not_argmax = compare("completion under a regex grammar", temperature=0, max_tokens=16,
                                 extra_body={"kvlease": {"grammar": {"regex": pattern}}})
    text = choice.text[len(prompt):]
    check(choice.finish_reason == "stop" and re.fullmatch(pattern, text) is not None,
          f"the completion follows {pattern!r} to its end: {text!r}")
    check(not_argmax > 0, f"the grammar moved {not_argmax} picks off the raw argmax, the logprobs staying raw")
    print(f"openai logprobs reference check passed in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--factual"] and len(sys.argv) in (3, 4):
        factual(sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else None)
    elif sys.argv[1:2] == ["--reference"] and len(sys.argv) == 4:
        reference_logprobs(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--rejects"] and len(sys.argv) == 3:
        rejects(sys.argv[2])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit(__doc__)
