"""The official `openai` package against a running `kvlease up --http-listen`.

Usage: python check.py BASE_URL             (e.g. http://127.0.0.1:8000/v1)
       python check.py --factual BASE_URL   (a real chat model, e.g. kvlease up --model smollm2)

Checks, each failing with a message and exit code 1:
- models.list names the served model;
- a completion, whole and streamed (greedy, so both give the same text), with
  usage (prompt, completion and cached tokens; the second request reuses the
  first one's cached prefix);
- a chat completion, whole and streamed, when the model has a chat template;
  with the seeded model (no template) the refusal is an openai.BadRequestError
  saying so;
- a request that cannot fit surfaces as openai.BadRequestError (HTTP 400)
  whose message names the limit.

With --factual: a chat completion, whole and streamed, answers "What is the
capital of France?" with an answer that names Paris.
"""

import sys

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
        check(e.status_code == 400 and "max_tokens 100000 is over the limit" in e.message,
              f"a request that cannot fit is an openai.BadRequestError: {e.message}")
    else:
        check(False, "a request that cannot fit was served")

    try:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    except openai.NotFoundError as e:
        check(e.code == "model_not_found", f"an unknown model is a 404: {e.message}")
    else:
        check(False, "an unknown model was served")
    print("openai package check passed")


def factual(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    answer = chat.choices[0].message.content
    print(f"Q: {messages[0]['content']}\nA: {answer}")
    check("Paris" in answer, f"the chat answer names Paris ({chat.choices[0].finish_reason}, "
                             f"{chat.usage.prompt_tokens} prompt + {chat.usage.completion_tokens} completion tokens)")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(streamed == answer, "the streamed chat gives the same answer")
    print("openai factual chat check passed")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--factual"] and len(sys.argv) == 3:
        factual(sys.argv[2])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit(__doc__)
