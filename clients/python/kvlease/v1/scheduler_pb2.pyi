from kvlease.v1 import cache_pb2 as _cache_pb2
from kvlease.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    CANCELLED: _ClassVar[FinishReason]
    REJECTED: _ClassVar[FinishReason]
    ERROR: _ClassVar[FinishReason]

class CapacityPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPACITY_POLICY_UNSPECIFIED: _ClassVar[CapacityPolicy]
    GUARANTEED_NO_EVICT: _ClassVar[CapacityPolicy]
    MAX_UTILIZATION: _ClassVar[CapacityPolicy]
    STATIC_BATCH: _ClassVar[CapacityPolicy]
FINISH_REASON_UNSPECIFIED: FinishReason
LENGTH: FinishReason
STOP: FinishReason
CANCELLED: FinishReason
REJECTED: FinishReason
ERROR: FinishReason
CAPACITY_POLICY_UNSPECIFIED: CapacityPolicy
GUARANTEED_NO_EVICT: CapacityPolicy
MAX_UTILIZATION: CapacityPolicy
STATIC_BATCH: CapacityPolicy

class GenerateRequest(_message.Message):
    __slots__ = ("text", "tokens", "max_tokens", "temperature", "top_p", "seed", "stop_tokens", "priority", "cache_salt", "request_id", "messages", "stop", "ignore_eos", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "retain", "n", "logprobs", "echo", "grammar", "beam_width")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    retain: RetainPrefix
    n: int
    logprobs: LogprobsRequest
    echo: bool
    grammar: _worker_pb2.Grammar
    beam_width: int
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., retain: _Optional[_Union[RetainPrefix, _Mapping]] = ..., n: _Optional[int] = ..., logprobs: _Optional[_Union[LogprobsRequest, _Mapping]] = ..., echo: _Optional[bool] = ..., grammar: _Optional[_Union[_worker_pb2.Grammar, _Mapping]] = ..., beam_width: _Optional[int] = ...) -> None: ...

class LogprobsRequest(_message.Message):
    __slots__ = ("top", "prompt")
    TOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    top: int
    prompt: bool
    def __init__(self, top: _Optional[int] = ..., prompt: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "bytes", "logprob", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: int
    bytes: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[int] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "bytes", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    bytes: bytes
    logprob: float
    def __init__(self, token: _Optional[int] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class RetainPrefix(_message.Message):
    __slots__ = ("tokens", "priority", "ttl_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    priority: int
    ttl_s: int
    def __init__(self, tokens: _Optional[int] = ..., priority: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "text", "finish_reason", "reject", "message", "reused_tokens", "preemptions", "prompt_tokens", "retained_tokens", "index", "logprobs", "prompt_logprobs", "prompt_text", "cumulative_logprob")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    reject: _cache_pb2.Reject
    message: str
    reused_tokens: int
    preemptions: int
    prompt_tokens: int
    retained_tokens: int
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_text: str
    cumulative_logprob: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., reject: _Optional[_Union[_cache_pb2.Reject, _Mapping]] = ..., message: _Optional[str] = ..., reused_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., retained_tokens: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("policy", "on_exhausted", "queued", "running", "preempted", "steps", "session_id", "epoch", "pools", "finished_length", "finished_stop", "cancelled", "rejected", "errors", "preemptions", "groups")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ON_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STOP_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    policy: CapacityPolicy
    on_exhausted: str
    queued: int
    running: int
    preempted: int
    steps: int
    session_id: int
    epoch: int
    pools: _containers.RepeatedCompositeFieldContainer[_cache_pb2.PoolStats]
    finished_length: int
    finished_stop: int
    cancelled: int
    rejected: int
    errors: int
    preemptions: int
    groups: _containers.RepeatedCompositeFieldContainer[WorkerGroup]
    def __init__(self, policy: _Optional[_Union[CapacityPolicy, str]] = ..., on_exhausted: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., preempted: _Optional[int] = ..., steps: _Optional[int] = ..., session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[_cache_pb2.PoolStats, _Mapping]]] = ..., finished_length: _Optional[int] = ..., finished_stop: _Optional[int] = ..., cancelled: _Optional[int] = ..., rejected: _Optional[int] = ..., errors: _Optional[int] = ..., preemptions: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[WorkerGroup, _Mapping]]] = ...) -> None: ...

class WorkerGroup(_message.Message):
    __slots__ = ("pool_group", "role")
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    pool_group: str
    role: str
    def __init__(self, pool_group: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...
