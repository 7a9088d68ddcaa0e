"""Streams one generation and prints its text as it comes, then how it ended.

Usage: python stream.py [ADDR] [PROMPT]    (ADDR defaults to 127.0.0.1:50051)
       python stream.py ADDR --chat QUESTION   (a chat, with the model's template)
"""

import sys

from kvlease import KvleaseClient


def main(argv):
    addr = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    chat = len(argv) > 2 and argv[2] == "--chat"
    prompt = argv[3 if chat else 2] if len(argv) > (3 if chat else 2) else "The capital of France is"
    with KvleaseClient(addr, timeout=120) as client:
        if chat:
            generation = client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=32)
        else:
            generation = client.generate(prompt, max_tokens=16)
        # a completion continues the prompt; a chat answers it
        print(prompt, end="\n" if chat else "", flush=True)
        tokens = 0
        for chunk in generation:
            print(chunk.text, end="", flush=True)
            tokens += len(chunk.tokens)
        f = generation.finish
        print(f"\n[{f.reason}: {f.prompt_tokens} prompt tokens ({f.reused_tokens} from cache), "
              f"{tokens} generated]")
        return 0 if f.reason in ("LENGTH", "STOP") and tokens > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
