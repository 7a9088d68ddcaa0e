"""`Generation` without a server: a fake call stands in for the gRPC stream.

Usage: python -m unittest discover -s clients/python/tests -p 'test_*.py'
(with the package's dependencies installed; `.ci/clients-test.sh` runs it).
"""

import unittest

import grpc

from kvlease.client import Generation, KvleaseError
from kvlease.v1 import scheduler_pb2


class _Rpc(grpc.RpcError):
    def __init__(self, code):
        super().__init__()
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "stopped"


class _Call:
    """A stream of `messages` that, once cancelled (or run out), raises the
    RpcError grpc raises: CANCELLED after cancel(), `then` otherwise."""

    def __init__(self, messages, then=grpc.StatusCode.UNAVAILABLE):
        self._messages = list(messages)
        self._then = then
        self._cancelled = False

    def __next__(self):
        if self._cancelled:
            raise _Rpc(grpc.StatusCode.CANCELLED)
        if not self._messages:
            raise _Rpc(self._then)
        return self._messages.pop(0)

    def cancel(self):
        self._cancelled = True


def _tokens(*ids):
    return scheduler_pb2.GenerateResponse(tokens=list(ids), text="x", prompt_tokens=5)


class GenerationTest(unittest.TestCase):
    def test_cancel_ends_the_stream_cancelled_without_raising(self):
        g = Generation(_Call([_tokens(1), _tokens(2)]))
        first = next(g)
        g.cancel()
        rest = list(g)
        self.assertEqual(first.tokens, (1,))
        self.assertEqual(rest, [])
        self.assertIsNotNone(g.finish)
        self.assertEqual(g.finish.reason, "CANCELLED")
        self.assertEqual(g.finish.prompt_tokens, 5)

    def test_a_cancel_the_client_did_not_ask_for_still_raises(self):
        g = Generation(_Call([_tokens(1)], then=grpc.StatusCode.CANCELLED))
        next(g)
        with self.assertRaises(KvleaseError) as e:
            list(g)
        self.assertEqual(e.exception.code, "CANCELLED")


class LogprobsTest(unittest.TestCase):
    def test_chunks_carry_their_tokens_logprobs_and_the_finish_the_prompts(self):
        top = [scheduler_pb2.TopLogprob(token=7, bytes=b"a", logprob=-0.25)]
        first = scheduler_pb2.GenerateResponse(
            tokens=[7],
            text="a",
            prompt_tokens=2,
            prompt_text="hi",
            logprobs=[scheduler_pb2.TokenLogprob(token=7, bytes=b"a", logprob=-0.25, top=top)],
            prompt_logprobs=[
                scheduler_pb2.TokenLogprob(token=104, bytes=b"h"),
                scheduler_pb2.TokenLogprob(token=105, bytes=b"i", logprob=-3.0),
            ],
        )
        last = scheduler_pb2.GenerateResponse(finish_reason=scheduler_pb2.LENGTH)
        c = Generation(_Call([first, last])).result()
        self.assertEqual(c.tokens, (7,))
        self.assertEqual(c.logprobs[0].logprob, -0.25)
        self.assertEqual(c.logprobs[0].top[0].bytes, b"a")
        self.assertIsNone(c.finish.prompt_logprobs[0].logprob, "the prompt's first has none")
        self.assertEqual(c.finish.prompt_logprobs[1].logprob, -3.0)
        self.assertEqual(c.finish.prompt_text, "hi")


class BeamTest(unittest.TestCase):
    def test_each_rank_gets_its_tokens_and_cumulative_logprob(self):
        def rank(i, ids, logprob):
            return [
                scheduler_pb2.GenerateResponse(tokens=ids, text="x" * len(ids), index=i),
                scheduler_pb2.GenerateResponse(
                    finish_reason=scheduler_pb2.STOP, index=i, cumulative_logprob=logprob
                ),
            ]

        g = Generation(_Call(rank(0, [1, 2], -0.5) + rank(1, [3], -0.75)), samples=2)
        best, second = g.results()
        self.assertEqual((best.tokens, second.tokens), ((1, 2), (3,)))
        self.assertEqual(best.finish.cumulative_logprob, -0.5)
        self.assertEqual(second.finish.cumulative_logprob, -0.75)
        plain = Generation(_Call([_tokens(1), scheduler_pb2.GenerateResponse(finish_reason=scheduler_pb2.LENGTH)]))
        self.assertIsNone(plain.result().finish.cumulative_logprob, "no beams, no cumulative logprob")


if __name__ == "__main__":
    unittest.main()
