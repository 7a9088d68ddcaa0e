"""Python client of the kvlease scheduler.

    from kvlease import KvleaseClient

    with KvleaseClient("127.0.0.1:50051") as client:
        generation = client.generate("The capital of France is", max_tokens=16)
        for chunk in generation:
            print(chunk.text, end="", flush=True)
        print(generation.finish.reason)

The generated stubs of every kvlease.v1 service are in `kvlease.v1`
(`scheduler_pb2_grpc.SchedulerStub`, `cache_pb2_grpc.CacheServiceStub`, ...).
"""

from .client import (
    Chunk,
    Completion,
    Finish,
    Generation,
    KvleaseClient,
    KvleaseError,
    Pool,
    Reject,
    Status,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "Chunk",
    "Completion",
    "Finish",
    "Generation",
    "KvleaseClient",
    "KvleaseError",
    "Pool",
    "Reject",
    "Status",
    "TokenLogprob",
    "TopLogprob",
]
