"""Structured output through the official `openai` package against a running
`kvlease up --http-listen` (any model; CI runs it on SmolLM2 and the seeded
model).

Usage: python structured.py BASE_URL [PROMPTS]   (e.g. http://127.0.0.1:8000/v1)

Checks, each failing with a message and exit code 1:
- response_format json_schema on PROMPTS (default 20) chat completions (or
  completions, for a model without a chat template), greedy and sampled, sent
  at once: every answer ends "stop", parses, and validates against its schema
  (the `jsonschema` package: an independent validator);
- response_format json_object: the answer parses to a JSON object;
- the kvlease.grammar extension (extra_body): a regex is followed;
- an invalid schema is an openai.BadRequestError (HTTP 400) whose param is
  response_format and whose message names the problem; a malformed
  response_format likewise.
"""

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "likes_tea": {"type": "boolean"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "likes_tea", "pets"],
    "additionalProperties": False,
}
PEOPLE = ["a baker", "a pilot", "a nurse", "a poet", "a farmer", "a judge", "a chef", "a sailor",
          "a painter", "a miner", "a teacher", "a monk", "a tailor", "a doctor", "a singer",
          "a guard", "a clerk", "a potter", "a hunter", "a scribe"]


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)
    print(f"ok: {what}")


def main(base_url, prompts=20):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    chat = True
    try:
        client.chat.completions.create(model=model, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}])
    except openai.BadRequestError:
        chat = False  # the seeded model has no chat template
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def ask(i, response_format=fmt, max_tokens=200, **kw):
        prompt = f"Describe {PEOPLE[i % len(PEOPLE)]} as a JSON object with name, age, city, likes_tea and pets."
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        if chat:
            r = client.chat.completions.create(model=model, max_tokens=max_tokens, response_format=response_format,
                                               messages=[{"role": "user", "content": prompt}], **sampled, **kw)
            return r.choices[0].finish_reason, r.choices[0].message.content
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                      extra_body={"response_format": response_format}, **sampled, **kw)
        return r.choices[0].finish_reason, r.choices[0].text

    with ThreadPoolExecutor(max_workers=prompts) as pool:
        answers = list(pool.map(ask, range(prompts)))
    for i, (finish, text) in enumerate(answers):
        check(finish == "stop", f"json_schema answer {i} ends stop ({finish}): {text!r}")
        try:
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            check(False, f"json_schema answer {i} parses and validates: {text!r}: {e}")
    check(True, f"{prompts} json_schema answers parse and validate against their schema")
    print("for example:", answers[0][1])

    finish, text = ask(0, response_format={"type": "json_object"}, max_tokens=200)
    if finish == "stop":
        check(isinstance(json.loads(text), dict), f"json_object answer is a JSON object: {text!r}")
    else:
        # any JSON object: a model may write on to max_tokens
        check(text.startswith("{"), f"json_object answer starts an object: {text!r}")

    r = client.completions.create(model=model, prompt="Answer yes or no, then a number:", max_tokens=16,
                                  temperature=0, extra_body={"kvlease": {"grammar": {"regex": "(yes|no) [0-9]{1,3}"}}})
    text = r.choices[0].text
    check(r.choices[0].finish_reason == "stop" and re.fullmatch("(yes|no) [0-9]{1,3}", text),
          f"kvlease.grammar regex is followed: {text!r}")

    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}}
    for response_format, needle in [(bad, "strnig"), ({"type": "yaml"}, "yaml")]:
        try:
            client.completions.create(model=model, prompt="x", max_tokens=4,
                                      extra_body={"response_format": response_format})
            check(False, f"response_format {response_format} was served")
        except openai.BadRequestError as e:
            param = (e.body or {}).get("param") if isinstance(e.body, dict) else None
            check(e.status_code == 400 and param == "response_format" and needle in e.message,
                  f"an invalid response_format is a 400 naming it (param {param!r}): {e.message}")
    print("openai structured output check passed")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        main(sys.argv[1])
    elif len(sys.argv) == 3 and sys.argv[2].isdigit():
        main(sys.argv[1], int(sys.argv[2]))
    else:
        sys.exit(__doc__)
