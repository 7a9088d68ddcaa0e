from kvlease.v1 import cache_pb2 as _cache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("name", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "rope_theta", "layer_windows", "max_context", "tokenizer_fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FFN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    tokenizer_fingerprint: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., ffn_size: _Optional[int] = ..., rope_theta: _Optional[float] = ..., layer_windows: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...

class WorkerPool(_message.Message):
    __slots__ = ("window", "num_layers", "num_blocks", "bytes_per_block", "host_blocks", "disk_blocks", "disk_held")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_HELD_FIELD_NUMBER: _ClassVar[int]
    window: int
    num_layers: int
    num_blocks: int
    bytes_per_block: int
    host_blocks: int
    disk_blocks: int
    disk_held: _containers.RepeatedCompositeFieldContainer[_cache_pb2.DiskBlock]
    def __init__(self, window: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_held: _Optional[_Iterable[_Union[_cache_pb2.DiskBlock, _Mapping]]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "tokens_per_block", "pools", "backend", "kv_dtype", "memory_budget_bytes", "weight_bytes", "activation_bytes", "max_batch_sequences", "max_batch_tokens", "device", "incarnation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    model: ModelShape
    tokens_per_block: int
    pools: _containers.RepeatedCompositeFieldContainer[WorkerPool]
    backend: str
    kv_dtype: str
    memory_budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    max_batch_sequences: int
    max_batch_tokens: int
    device: str
    incarnation: int
    def __init__(self, model: _Optional[_Union[ModelShape, _Mapping]] = ..., tokens_per_block: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[WorkerPool, _Mapping]]] = ..., backend: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., activation_bytes: _Optional[int] = ..., max_batch_sequences: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., device: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "prompt_len", "min_tokens", "stop_ids", "constrained")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_len: int
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    constrained: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_len: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., constrained: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_object", "json_schema", "lark", "regex")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    lark: str
    regex: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., lark: _Optional[str] = ..., regex: _Optional[str] = ...) -> None: ...

class TokenHistory(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardSequence(_message.Message):
    __slots__ = ("seq_id", "tokens", "start_pos", "tables", "return_all_argmax", "sampling", "copies", "trace", "feed_previous", "history", "logprobs", "grammar", "peer_pull")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RETURN_ALL_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    FEED_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    tables: _containers.RepeatedCompositeFieldContainer[_cache_pb2.BlockTable]
    return_all_argmax: bool
    sampling: SamplingParams
    copies: _containers.RepeatedCompositeFieldContainer[_cache_pb2.BlockCopy]
    trace: SequenceTrace
    feed_previous: bool
    history: TokenHistory
    logprobs: LogprobsParams
    grammar: Grammar
    peer_pull: PeerPull
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[_cache_pb2.BlockTable, _Mapping]]] = ..., return_all_argmax: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., copies: _Optional[_Iterable[_Union[_cache_pb2.BlockCopy, _Mapping]]] = ..., trace: _Optional[_Union[SequenceTrace, _Mapping]] = ..., feed_previous: _Optional[bool] = ..., history: _Optional[_Union[TokenHistory, _Mapping]] = ..., logprobs: _Optional[_Union[LogprobsParams, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., peer_pull: _Optional[_Union[PeerPull, _Mapping]] = ...) -> None: ...

class LogprobsParams(_message.Message):
    __slots__ = ("top", "prompt", "next_prompt_token")
    TOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEXT_PROMPT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    top: int
    prompt: bool
    next_prompt_token: int
    def __init__(self, top: _Optional[int] = ..., prompt: _Optional[bool] = ..., next_prompt_token: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceTrace(_message.Message):
    __slots__ = ("traceparent", "reused_tokens", "onboarded_blocks", "replica")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ONBOARDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    reused_tokens: int
    onboarded_blocks: int
    replica: str
    def __init__(self, traceparent: _Optional[str] = ..., reused_tokens: _Optional[int] = ..., onboarded_blocks: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("step", "sequences", "tier_copies", "after_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TIER_COPIES_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    sequences: _containers.RepeatedCompositeFieldContainer[ForwardSequence]
    tier_copies: _containers.RepeatedCompositeFieldContainer[_cache_pb2.TierCopy]
    after_step: int
    def __init__(self, step: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[ForwardSequence, _Mapping]]] = ..., tier_copies: _Optional[_Iterable[_Union[_cache_pb2.TierCopy, _Mapping]]] = ..., after_step: _Optional[int] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("seq_id", "next_token", "argmax", "logprobs", "error", "pulled_bytes", "pull_us")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_US_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    next_token: int
    argmax: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    error: str
    pulled_bytes: int
    pull_us: int
    def __init__(self, seq_id: _Optional[int] = ..., next_token: _Optional[int] = ..., argmax: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., error: _Optional[str] = ..., pulled_bytes: _Optional[int] = ..., pull_us: _Optional[int] = ...) -> None: ...

class PeerPull(_message.Message):
    __slots__ = ("address", "transfer_id", "blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    transfer_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[PeerBlockCopy]
    def __init__(self, address: _Optional[str] = ..., transfer_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[PeerBlockCopy, _Mapping]]] = ...) -> None: ...

class PeerBlockCopy(_message.Message):
    __slots__ = ("window", "src_block", "dst_block", "tokens")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    window: int
    src_block: int
    dst_block: int
    tokens: int
    def __init__(self, window: _Optional[int] = ..., src_block: _Optional[int] = ..., dst_block: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "tokenizer_fingerprint", "kv_dtype", "blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    tokenizer_fingerprint: str
    kv_dtype: str
    blocks: _containers.RepeatedCompositeFieldContainer[PeerBlock]
    def __init__(self, transfer_id: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[PeerBlock, _Mapping]]] = ...) -> None: ...

class PeerBlock(_message.Message):
    __slots__ = ("window", "block", "tokens")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    window: int
    block: int
    tokens: int
    def __init__(self, window: _Optional[int] = ..., block: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("index", "offset", "block_bytes", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    block_bytes: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., block_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("results", "compute_us")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ForwardResult]
    compute_us: int
    def __init__(self, results: _Optional[_Iterable[_Union[ForwardResult, _Mapping]]] = ..., compute_us: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    def __init__(self, fingerprint: _Optional[str] = ...) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("model", "fingerprint", "kind", "tokenizer_json", "chat_template", "bos_id", "bos_token", "eos_token", "end_ids", "add_bos")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    kind: str
    tokenizer_json: str
    chat_template: str
    bos_id: int
    bos_token: str
    eos_token: str
    end_ids: _containers.RepeatedScalarFieldContainer[int]
    add_bos: bool
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kind: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_id: _Optional[int] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., end_ids: _Optional[_Iterable[int]] = ..., add_bos: _Optional[bool] = ...) -> None: ...
