"""`KvleaseClient`: a thin, typed wrapper over the generated Scheduler stub.

A request the scheduler cannot serve for lack of KV blocks is an answer,
not an error: its stream ends with `Finish.reason == "REJECTED"` and the
cache's figures in `Finish.reject`. Problems with the call itself (a
malformed request, an unreachable server) raise `KvleaseError` with the
gRPC status code and the server's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .v1 import cache_pb2, scheduler_pb2, scheduler_pb2_grpc

# A chat message: {"role": ..., "content": ...} or (role, content).
Message = Union[Mapping[str, str], Tuple[str, str]]


class KvleaseError(Exception):
    """A call failed: `code` is the gRPC status code's name
    (``"INVALID_ARGUMENT"``, ``"UNAVAILABLE"``, ...), `details` the server's
    message."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "KvleaseError":
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code.name if code is not None else "UNKNOWN", details or "")


@dataclass(frozen=True)
class Reject:
    """Why the cache could not supply a request's KV blocks, with its figures."""

    reason: str
    """``POOL_EXHAUSTED`` (transient), ``EXCEEDS_CAPACITY`` (never fits), ..."""
    pool_id: int
    window: int
    blocks_needed: int
    blocks_free: int
    blocks_pending_free: int
    message: str

    @classmethod
    def from_pb(cls, r: cache_pb2.Reject) -> "Reject":
        return cls(
            reason=cache_pb2.RejectReason.Name(r.reason),
            pool_id=r.pool_id,
            window=r.window,
            blocks_needed=r.blocks_needed,
            blocks_free=r.blocks_free,
            blocks_pending_free=r.blocks_pending_free,
            message=r.message,
        )


@dataclass(frozen=True)
class TopLogprob:
    """An alternative at a token's position."""

    token: int
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (of the model's raw distribution, before
    logit_bias, penalties and temperature) and the most likely alternatives
    at its position, the most likely first."""

    token: int
    bytes: bytes
    logprob: Optional[float]
    """None for the prompt's first token."""
    top: Tuple[TopLogprob, ...]

    @classmethod
    def from_pb(cls, l: scheduler_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(
            token=l.token,
            bytes=l.bytes,
            logprob=l.logprob if l.HasField("logprob") else None,
            top=tuple(TopLogprob(token=t.token, bytes=t.bytes, logprob=t.logprob) for t in l.top),
        )


@dataclass(frozen=True)
class Chunk:
    """Tokens generated since the previous chunk and their text (complete
    characters only; special tokens left out)."""

    text: str
    tokens: Tuple[int, ...]
    logprobs: Tuple[TokenLogprob, ...] = ()
    """With `logprobs`: one per token."""
    index: int = 0
    """The sample (`generate(n=...)`) the chunk belongs to, 0 to n - 1."""


@dataclass(frozen=True)
class Finish:
    """How a generation ended."""

    reason: str
    """``LENGTH``, ``STOP``, ``CANCELLED``, ``REJECTED`` or ``ERROR``."""
    reject: Optional[Reject]
    """The cache's reason and figures, for ``REJECTED``."""
    message: str
    """What happened, for ``ERROR`` and ``CANCELLED``."""
    prompt_tokens: int
    """The prompt as the scheduler encoded it (chat template included)."""
    reused_tokens: int
    """Prompt tokens served from cached prefix blocks."""
    preemptions: int
    prompt_logprobs: Tuple[TokenLogprob, ...] = ()
    """With `prompt_logprobs=True`: one per prompt token."""
    prompt_text: str = ""
    """With `echo=True`: the prompt's text."""
    cumulative_logprob: Optional[float] = None
    """With `beam_width`: the hypothesis's cumulative logprob."""

    @property
    def rejected(self) -> bool:
        return self.reason == "REJECTED"


@dataclass(frozen=True)
class Completion:
    """A whole generation: its text, tokens and finish."""

    text: str
    tokens: Tuple[int, ...]
    finish: Finish
    logprobs: Tuple[TokenLogprob, ...] = ()
    """With `logprobs`: one per token."""


class Generation(Iterator[Chunk]):
    """The stream of one `Generate` call: iterate for `Chunk`s; once the
    iteration ends, `finish` says how (`finishes[i]` for sample i of a
    request of several: each chunk names its sample in `index`). `cancel()`
    stops it early: the scheduler frees the request's blocks and the stream
    ends with `finish.reason == "CANCELLED"`, an answer like the others, not
    an exception."""

    def __init__(self, call, samples: int = 1):
        self._call = call
        self._samples = max(1, samples)
        self.finishes: Dict[int, Finish] = {}
        self._cancelled = False
        self._first = True
        self._prompt_tokens = 0
        self._reused_tokens = 0
        self._prompt_logprobs: Tuple[TokenLogprob, ...] = ()
        self._prompt_text = ""
        self.finish: Optional[Finish] = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Chunk:
        while self.finish is None:
            if len(self.finishes) >= self._samples:
                self.finish = self.finishes.get(0)
                break
            try:
                message = next(self._call)
            except StopIteration:
                if not self.finishes:
                    raise KvleaseError("UNKNOWN", "the stream ended without a finish reason") from None
                # a request-wide end (a deadline) names one sample: it ends them all
                ended = next(iter(self.finishes.values()))
                for i in range(self._samples):
                    self.finishes.setdefault(i, ended)
                continue
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    for i in range(self._samples):
                        self.finishes.setdefault(
                            i,
                            Finish(
                                reason="CANCELLED",
                                reject=None,
                                message="cancelled by the client",
                                prompt_tokens=self._prompt_tokens,
                                reused_tokens=self._reused_tokens,
                                preemptions=0,
                                prompt_logprobs=self._prompt_logprobs,
                                prompt_text=self._prompt_text,
                            ),
                        )
                    continue
                raise KvleaseError.from_rpc(e) from None
            if self._first:
                self._first = False
                self._prompt_tokens = message.prompt_tokens
                self._reused_tokens = message.reused_tokens
                self._prompt_text = message.prompt_text
            if message.prompt_logprobs:
                self._prompt_logprobs = tuple(TokenLogprob.from_pb(l) for l in message.prompt_logprobs)
            if message.finish_reason != scheduler_pb2.FINISH_REASON_UNSPECIFIED:
                self.finishes[message.index] = Finish(
                    reason=scheduler_pb2.FinishReason.Name(message.finish_reason),
                    reject=Reject.from_pb(message.reject) if message.HasField("reject") else None,
                    message=message.message,
                    prompt_tokens=self._prompt_tokens,
                    reused_tokens=self._reused_tokens,
                    preemptions=message.preemptions,
                    prompt_logprobs=self._prompt_logprobs,
                    prompt_text=self._prompt_text,
                    cumulative_logprob=(
                        message.cumulative_logprob if message.HasField("cumulative_logprob") else None
                    ),
                )
            if message.tokens or message.text:
                return Chunk(
                    text=message.text,
                    tokens=tuple(message.tokens),
                    logprobs=tuple(TokenLogprob.from_pb(l) for l in message.logprobs),
                    index=message.index,
                )
        raise StopIteration

    def cancel(self) -> None:
        """Stops the request; the iteration then ends with `finish.reason ==
        "CANCELLED"` (unless the stream had already finished)."""
        self._cancelled = True
        self._call.cancel()

    def result(self) -> Completion:
        """Reads the rest of the stream; the whole completion (of a request
        of one sample: `results()` reads several)."""
        if self._samples != 1:
            raise ValueError(f"the request asked {self._samples} samples: read them with results()")
        return self.results()[0]

    def results(self) -> List[Completion]:
        """Reads the rest of the stream; one whole completion per sample, in
        index order."""
        chunks = list(self)
        return [
            Completion(
                text="".join(c.text for c in chunks if c.index == i),
                tokens=tuple(t for c in chunks if c.index == i for t in c.tokens),
                finish=self.finishes[i],
                logprobs=tuple(l for c in chunks if c.index == i for l in c.logprobs),
            )
            for i in range(self._samples)
        ]


@dataclass(frozen=True)
class Pool:
    """One KV pool's figures (blocks by state, counters since start)."""

    pool_group: str
    pool_id: int
    window: int
    tokens_per_block: int
    total: int
    free: int
    cached_evictable: int
    in_use: int
    fenced: int
    grants: int
    rejects: int
    evictions: int
    reuse_lookups: int
    reuse_hits: int


@dataclass(frozen=True)
class Status:
    """The scheduler's policy, queue, counters and pools."""

    policy: str
    on_exhausted: str
    queued: int
    running: int
    preempted: int
    steps: int
    pools: Tuple[Pool, ...]
    finished_length: int
    finished_stop: int
    cancelled: int
    rejected: int
    errors: int
    preemptions: int


def _pool(p: cache_pb2.PoolStats) -> Pool:
    return Pool(**{name: getattr(p, name) for name in Pool.__dataclass_fields__})


def _message(m: Message) -> scheduler_pb2.ChatMessage:
    if isinstance(m, Mapping):
        return scheduler_pb2.ChatMessage(role=m["role"], content=m["content"])
    role, content = m
    return scheduler_pb2.ChatMessage(role=role, content=content)


class KvleaseClient:
    """A client of one scheduler.

    `addr` is ``host:port``. `tls`: ``False`` for plaintext, ``True`` for TLS
    with the system's roots, or the PEM bytes of the root certificate to
    trust (`kvlease certs` writes ``ca.pem``). `cert`, with TLS: the PEM bytes
    of a client certificate and its key (``(cert_pem, key_pem)``), for mTLS as
    the principal it names. `token`, when given, goes with every call as
    ``authorization: Bearer TOKEN`` (a principal of the scheduler's
    ``--token-file``). `timeout` (seconds) bounds each call unless the call
    gives its own.
    """

    def __init__(
        self,
        addr: str,
        *,
        tls: Union[bool, bytes] = False,
        token: Optional[str] = None,
        cert: Optional[Tuple[bytes, bytes]] = None,
        timeout: Optional[float] = None,
    ):
        if tls is False:
            if cert is not None:
                raise ValueError("a client certificate needs tls")
            self._channel = grpc.insecure_channel(addr)
        else:
            roots = tls if isinstance(tls, bytes) else None
            chain, key = cert if cert is not None else (None, None)
            credentials = grpc.ssl_channel_credentials(
                root_certificates=roots, private_key=key, certificate_chain=chain
            )
            self._channel = grpc.secure_channel(addr, credentials)
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._timeout = timeout
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> "KvleaseClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        text: Optional[str] = None,
        *,
        tokens: Optional[Sequence[int]] = None,
        messages: Optional[Iterable[Message]] = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 0.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        min_tokens: int = 0,
        retain: Optional[Mapping[str, int]] = None,
        logprobs: Optional[int] = None,
        prompt_logprobs: bool = False,
        echo: bool = False,
        n: int = 1,
        beam_width: int = 1,
        stop: Sequence[str] = (),
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        request_id: str = "",
        timeout: Optional[float] = None,
    ) -> Generation:
        """Streams a generation from exactly one of `text`, `tokens` (prompt
        token ids) and `messages` (a chat, rendered with the model's own
        template). `temperature` 0 is greedy; `top_k`, `min_p`, the penalties
        (0: off; `repetition_penalty` 0 is read as 1), `logit_bias` (token id
        to a bias in [-100, 100]) and `min_tokens` as the server's
        `GenerateRequest` documents them. `retain` asks the cache to keep a
        prompt prefix: `{"tokens": N, "priority": P, "ttl_s": T}`.
        `logprobs=N` (0 to 20) gives each chunk its tokens' log-probabilities
        with N alternatives (of the raw distribution); `prompt_logprobs`
        also the prompt's (`finish.prompt_logprobs`; the request then reuses
        no cached prefix); `echo` the prompt's text (`finish.prompt_text`).
        `n` (1 to 16) parallel samples of the one prompt, leased and
        prefilled once (sample 0 keeps `seed`, the others derive theirs):
        chunks carry their sample's `index`; read them with `results()`.
        `beam_width` (1 to 10; 1: off) runs a deterministic beam search over
        the raw distribution (its beams share KV through forks) and answers
        its best `n` (at most `beam_width`) hypotheses at the end: `index`
        is the rank, `finishes[i].cumulative_logprob` its logprob; sampling
        parameters, stop strings, `logprobs` and `min_tokens` are refused
        with it."""
        if prompt_logprobs and logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (the number of alternatives)")
        given = [name for name, v in (("text", text), ("tokens", tokens), ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, tokens and messages (got {given or 'none'})")
        request = scheduler_pb2.GenerateRequest(
            text=text or "",
            tokens=list(tokens or ()),
            messages=[_message(m) for m in messages or ()],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=dict(logit_bias or {}),
            min_tokens=min_tokens,
            retain=scheduler_pb2.RetainPrefix(**retain) if retain else None,
            logprobs=(
                scheduler_pb2.LogprobsRequest(top=logprobs, prompt=prompt_logprobs) if logprobs is not None else None
            ),
            echo=echo,
            n=n,
            beam_width=beam_width,
            stop=list(stop),
            stop_tokens=list(stop_tokens),
            ignore_eos=ignore_eos,
            priority=priority,
            cache_salt=cache_salt,
            request_id=request_id,
        )
        call = self._scheduler.Generate(request, timeout=self._timeout_of(timeout), metadata=self._metadata)
        return Generation(call, samples=n)

    def complete(self, text: Optional[str] = None, **kwargs) -> Completion:
        """`generate(...)` read to its end."""
        return self.generate(text, **kwargs).result()

    def status(self, *, timeout: Optional[float] = None) -> Status:
        """The scheduler's queue, counters and pool figures."""
        try:
            s = self._scheduler.GetStatus(
                scheduler_pb2.GetStatusRequest(), timeout=self._timeout_of(timeout), metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise KvleaseError.from_rpc(e) from None
        return Status(
            policy=scheduler_pb2.CapacityPolicy.Name(s.policy),
            on_exhausted=s.on_exhausted,
            queued=s.queued,
            running=s.running,
            preempted=s.preempted,
            steps=s.steps,
            pools=tuple(_pool(p) for p in s.pools),
            finished_length=s.finished_length,
            finished_stop=s.finished_stop,
            cancelled=s.cancelled,
            rejected=s.rejected,
            errors=s.errors,
            preemptions=s.preemptions,
        )

    def health(self, service: str = "", *, timeout: Optional[float] = 5.0) -> bool:
        """Whether the server (or `service`, e.g. ``"kvlease.v1.Scheduler"``)
        is SERVING. An unknown service raises KvleaseError(NOT_FOUND)."""
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise KvleaseError.from_rpc(e) from None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _timeout_of(self, timeout: Optional[float]) -> Optional[float]:
        return timeout if timeout is not None else self._timeout
