from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    POOL_EXHAUSTED: _ClassVar[RejectReason]
    EXCEEDS_CAPACITY: _ClassVar[RejectReason]
    ROLLED_BACK: _ClassVar[RejectReason]
    UNKNOWN_SEQUENCE: _ClassVar[RejectReason]
    DUPLICATE_SEQUENCE: _ClassVar[RejectReason]
    QUOTA_EXCEEDED: _ClassVar[RejectReason]
    CACHE_RESTARTED: _ClassVar[RejectReason]
    QUEUE_TIMEOUT: _ClassVar[RejectReason]
    LENGTH_MISMATCH: _ClassVar[RejectReason]

class ReleaseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_STATUS_UNSPECIFIED: _ClassVar[ReleaseStatus]
    RELEASED: _ClassVar[ReleaseStatus]
    ALREADY_RELEASED: _ClassVar[ReleaseStatus]
    UNKNOWN: _ClassVar[ReleaseStatus]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE: _ClassVar[Tier]
    HOST: _ClassVar[Tier]
    DISK: _ClassVar[Tier]
REJECT_REASON_UNSPECIFIED: RejectReason
POOL_EXHAUSTED: RejectReason
EXCEEDS_CAPACITY: RejectReason
ROLLED_BACK: RejectReason
UNKNOWN_SEQUENCE: RejectReason
DUPLICATE_SEQUENCE: RejectReason
QUOTA_EXCEEDED: RejectReason
CACHE_RESTARTED: RejectReason
QUEUE_TIMEOUT: RejectReason
LENGTH_MISMATCH: RejectReason
RELEASE_STATUS_UNSPECIFIED: ReleaseStatus
RELEASED: ReleaseStatus
ALREADY_RELEASED: ReleaseStatus
UNKNOWN: ReleaseStatus
DEVICE: Tier
HOST: Tier
DISK: Tier

class PoolSpec(_message.Message):
    __slots__ = ("window", "num_blocks", "host_blocks", "disk_blocks", "disk_held", "bytes_per_block")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    window: int
    num_blocks: int
    host_blocks: int
    disk_blocks: int
    disk_held: _containers.RepeatedCompositeFieldContainer[DiskBlock]
    bytes_per_block: int
    def __init__(self, window: _Optional[int] = ..., num_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_held: _Optional[_Iterable[_Union[DiskBlock, _Mapping]]] = ..., bytes_per_block: _Optional[int] = ...) -> None: ...

class DiskBlock(_message.Message):
    __slots__ = ("block", "hash", "parent")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    block: int
    hash: int
    parent: int
    def __init__(self, block: _Optional[int] = ..., hash: _Optional[int] = ..., parent: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_group", "tokens_per_block", "pools", "worker_incarnation", "peer_key", "session_id")
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    WORKER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool_group: str
    tokens_per_block: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolSpec]
    worker_incarnation: int
    peer_key: str
    session_id: int
    def __init__(self, pool_group: _Optional[str] = ..., tokens_per_block: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolSpec, _Mapping]]] = ..., worker_incarnation: _Optional[int] = ..., peer_key: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool_group",)
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    pool_group: str
    def __init__(self, pool_group: _Optional[str] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ("pools_removed", "blocks_removed")
    POOLS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    pools_removed: int
    blocks_removed: int
    def __init__(self, pools_removed: _Optional[int] = ..., blocks_removed: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "window", "num_blocks", "tokens_per_block", "host_blocks", "disk_blocks")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    num_blocks: int
    tokens_per_block: int
    host_blocks: int
    disk_blocks: int
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., num_blocks: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pools", "already_registered")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    already_registered: bool
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., already_registered: _Optional[bool] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("holder", "ttl_ms")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    ttl_ms: int
    def __init__(self, holder: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "ttl_ms", "max_batch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    ttl_ms: int
    max_batch: int
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("sequences_released", "blocks_returned")
    SEQUENCES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    sequences_released: int
    blocks_returned: int
    def __init__(self, sequences_released: _Optional[int] = ..., blocks_returned: _Optional[int] = ...) -> None: ...

class ExtraTokens(_message.Message):
    __slots__ = ("draft", "extra_kv", "extra_decoding_steps")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KV_FIELD_NUMBER: _ClassVar[int]
    EXTRA_DECODING_STEPS_FIELD_NUMBER: _ClassVar[int]
    draft: int
    extra_kv: int
    extra_decoding_steps: int
    def __init__(self, draft: _Optional[int] = ..., extra_kv: _Optional[int] = ..., extra_decoding_steps: _Optional[int] = ...) -> None: ...

class SequenceSpec(_message.Message):
    __slots__ = ("seq_id", "pool_group", "prompt_tokens", "num_tokens", "extra", "beam_width", "max_new_tokens", "priority", "cache_salt", "reserve_full_life", "traceparent", "prefill_tokens", "refusal_retried", "retain", "fork_of", "peer_pull", "handoff_of")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FULL_LIFE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_RETRIED_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_OF_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    pool_group: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    extra: ExtraTokens
    beam_width: int
    max_new_tokens: int
    priority: int
    cache_salt: str
    reserve_full_life: bool
    traceparent: str
    prefill_tokens: int
    refusal_retried: bool
    retain: RetentionHint
    fork_of: int
    peer_pull: PeerPullRates
    handoff_of: int
    def __init__(self, seq_id: _Optional[int] = ..., pool_group: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., extra: _Optional[_Union[ExtraTokens, _Mapping]] = ..., beam_width: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., reserve_full_life: _Optional[bool] = ..., traceparent: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., refusal_retried: _Optional[bool] = ..., retain: _Optional[_Union[RetentionHint, _Mapping]] = ..., fork_of: _Optional[int] = ..., peer_pull: _Optional[_Union[PeerPullRates, _Mapping]] = ..., handoff_of: _Optional[int] = ...) -> None: ...

class RetentionHint(_message.Message):
    __slots__ = ("tokens", "priority", "ttl_ms", "tenant")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    priority: int
    ttl_ms: int
    tenant: str
    def __init__(self, tokens: _Optional[int] = ..., priority: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "atomic", "sequences", "warmup")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    step: int
    atomic: bool
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceSpec]
    warmup: bool
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., atomic: _Optional[bool] = ..., sequences: _Optional[_Iterable[_Union[SequenceSpec, _Mapping]]] = ..., warmup: _Optional[bool] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("pool_id", "window", "beam", "first_block", "block_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    beam: int
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., beam: _Optional[int] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("seq_id", "tables", "reused_tokens", "capacity_tokens", "copies", "tier_copies", "retained_tokens", "peer_copies", "peer_decision")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    TIER_COPIES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_COPIES_FIELD_NUMBER: _ClassVar[int]
    PEER_DECISION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    reused_tokens: int
    capacity_tokens: int
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    tier_copies: _containers.RepeatedCompositeFieldContainer[TierCopy]
    retained_tokens: int
    peer_copies: _containers.RepeatedCompositeFieldContainer[PeerCopy]
    peer_decision: PeerPullDecision
    def __init__(self, seq_id: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., reused_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., tier_copies: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ..., retained_tokens: _Optional[int] = ..., peer_copies: _Optional[_Iterable[_Union[PeerCopy, _Mapping]]] = ..., peer_decision: _Optional[_Union[PeerPullDecision, _Mapping]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("pool_id", "window", "src_block", "dst_block", "tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    src_block: int
    dst_block: int
    tokens: int
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., src_block: _Optional[int] = ..., dst_block: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TierCopy(_message.Message):
    __slots__ = ("pool_id", "window", "direction", "device_block", "host_block", "disk_block", "hash", "parent")
    class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DEMOTE: _ClassVar[TierCopy.Direction]
        ONBOARD: _ClassVar[TierCopy.Direction]
        SPILL: _ClassVar[TierCopy.Direction]
        LOAD: _ClassVar[TierCopy.Direction]
    DEMOTE: TierCopy.Direction
    ONBOARD: TierCopy.Direction
    SPILL: TierCopy.Direction
    LOAD: TierCopy.Direction
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    direction: TierCopy.Direction
    device_block: int
    host_block: int
    disk_block: int
    hash: int
    parent: int
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., direction: _Optional[_Union[TierCopy.Direction, str]] = ..., device_block: _Optional[int] = ..., host_block: _Optional[int] = ..., disk_block: _Optional[int] = ..., hash: _Optional[int] = ..., parent: _Optional[int] = ...) -> None: ...

class PeerPullRates(_message.Message):
    __slots__ = ("link_bytes_per_s", "prefill_tokens_per_s", "overhead_us")
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_US_FIELD_NUMBER: _ClassVar[int]
    link_bytes_per_s: int
    prefill_tokens_per_s: int
    overhead_us: int
    def __init__(self, link_bytes_per_s: _Optional[int] = ..., prefill_tokens_per_s: _Optional[int] = ..., overhead_us: _Optional[int] = ...) -> None: ...

class PeerCopy(_message.Message):
    __slots__ = ("pool_id", "window", "dst_block", "src_group", "src_pool_id", "src_block", "transfer_id", "tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SRC_GROUP_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    dst_block: int
    src_group: str
    src_pool_id: int
    src_block: int
    transfer_id: int
    tokens: int
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., dst_block: _Optional[int] = ..., src_group: _Optional[str] = ..., src_pool_id: _Optional[int] = ..., src_block: _Optional[int] = ..., transfer_id: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class PeerPullDecision(_message.Message):
    __slots__ = ("src_group", "blocks", "bytes", "pull_us", "recompute_us", "pulled", "forced")
    SRC_GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_US_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    src_group: str
    blocks: int
    bytes: int
    pull_us: int
    recompute_us: int
    pulled: bool
    forced: bool
    def __init__(self, src_group: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., pull_us: _Optional[int] = ..., recompute_us: _Optional[int] = ..., pulled: _Optional[bool] = ..., forced: _Optional[bool] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("seq_id", "reason", "pool_id", "window", "blocks_needed", "blocks_free", "blocks_pending_free", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PENDING_FREE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: RejectReason
    pool_id: int
    window: int
    blocks_needed: int
    blocks_free: int
    blocks_pending_free: int
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., pool_id: _Optional[int] = ..., window: _Optional[int] = ..., blocks_needed: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_pending_free: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SequenceOutcome(_message.Message):
    __slots__ = ("grant", "reject")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    grant: Grant
    reject: Reject
    def __init__(self, grant: _Optional[_Union[Grant, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SequenceOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SequenceOutcome, _Mapping]]] = ...) -> None: ...

class ExtendItem(_message.Message):
    __slots__ = ("seq_id", "new_tokens", "num_tokens", "traceparent", "written_tokens", "from_length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FROM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    traceparent: str
    written_tokens: int
    from_length: int
    def __init__(self, seq_id: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ..., written_tokens: _Optional[int] = ..., from_length: _Optional[int] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "atomic", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    step: int
    atomic: bool
    items: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., atomic: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ...) -> None: ...

class ExtendResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SequenceOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SequenceOutcome, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "seq_ids", "fence_step", "traceparents", "discard_unwritten")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FENCE_STEP_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    DISCARD_UNWRITTEN_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    fence_step: int
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    discard_unwritten: bool
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., fence_step: _Optional[int] = ..., traceparents: _Optional[_Iterable[str]] = ..., discard_unwritten: _Optional[bool] = ...) -> None: ...

class ReleaseResult(_message.Message):
    __slots__ = ("seq_id", "status", "blocks_freed", "blocks_fenced")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FENCED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: ReleaseStatus
    blocks_freed: int
    blocks_fenced: int
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[_Union[ReleaseStatus, str]] = ..., blocks_freed: _Optional[int] = ..., blocks_fenced: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReleaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReleaseResult, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "release", "complete_step", "extend")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    release: StepRelease
    complete_step: int
    extend: StepExtend
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., release: _Optional[_Union[StepRelease, _Mapping]] = ..., complete_step: _Optional[int] = ..., extend: _Optional[_Union[StepExtend, _Mapping]] = ...) -> None: ...

class StepRelease(_message.Message):
    __slots__ = ("seq_ids", "fence_step", "traceparents", "discard_unwritten")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FENCE_STEP_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    DISCARD_UNWRITTEN_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    fence_step: int
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    discard_unwritten: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., fence_step: _Optional[int] = ..., traceparents: _Optional[_Iterable[str]] = ..., discard_unwritten: _Optional[bool] = ...) -> None: ...

class StepExtend(_message.Message):
    __slots__ = ("step", "atomic", "items")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    step: int
    atomic: bool
    items: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    def __init__(self, step: _Optional[int] = ..., atomic: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("release", "complete", "extend")
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    release: ReleaseResponse
    complete: CompleteStepResponse
    extend: ExtendResponse
    def __init__(self, release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., complete: _Optional[_Union[CompleteStepResponse, _Mapping]] = ..., extend: _Optional[_Union[ExtendResponse, _Mapping]] = ...) -> None: ...

class CompleteStepRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    step: int
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CompleteStepResponse(_message.Message):
    __slots__ = ("blocks_returned",)
    BLOCKS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    blocks_returned: int
    def __init__(self, blocks_returned: _Optional[int] = ...) -> None: ...

class EstimateRequest(_message.Message):
    __slots__ = ("shapes",)
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    shapes: _containers.RepeatedCompositeFieldContainer[SequenceSpec]
    def __init__(self, shapes: _Optional[_Iterable[_Union[SequenceSpec, _Mapping]]] = ...) -> None: ...

class PoolEstimate(_message.Message):
    __slots__ = ("pool_id", "window", "total_blocks", "peak_blocks", "pool_blocks")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    window: int
    total_blocks: int
    peak_blocks: int
    pool_blocks: int
    def __init__(self, pool_id: _Optional[int] = ..., window: _Optional[int] = ..., total_blocks: _Optional[int] = ..., peak_blocks: _Optional[int] = ..., pool_blocks: _Optional[int] = ...) -> None: ...

class ShapeEstimate(_message.Message):
    __slots__ = ("pools", "fits")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolEstimate]
    fits: bool
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolEstimate, _Mapping]]] = ..., fits: _Optional[bool] = ...) -> None: ...

class EstimateResponse(_message.Message):
    __slots__ = ("estimates",)
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    estimates: _containers.RepeatedCompositeFieldContainer[ShapeEstimate]
    def __init__(self, estimates: _Optional[_Iterable[_Union[ShapeEstimate, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_group",)
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    pool_group: str
    def __init__(self, pool_group: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_group", "pool_id", "window", "tokens_per_block", "total", "free", "cached_evictable", "in_use", "fenced", "grants", "rejects", "evictions", "reuse_lookups", "reuse_hits", "leaks_reclaimed", "hit_rate_estimates", "host_total", "host_free", "host_pending", "host_cached", "host_pinned", "demotions", "onboards", "demotions_dropped", "eviction_policy", "current_policy", "policy_estimates", "policy_switches", "fork_shared", "fork_copies", "disk_total", "disk_free", "disk_pending", "disk_cached", "disk_pinned", "spills", "loads", "disk_invalidated", "handoff_blocks")
    POOL_GROUP_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CACHED_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    REJECTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REUSE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REUSE_HITS_FIELD_NUMBER: _ClassVar[int]
    LEAKS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_PENDING_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_FIELD_NUMBER: _ClassVar[int]
    HOST_PINNED_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    ONBOARDS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    POLICY_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    FORK_SHARED_FIELD_NUMBER: _ClassVar[int]
    FORK_COPIES_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_FIELD_NUMBER: _ClassVar[int]
    DISK_PENDING_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_FIELD_NUMBER: _ClassVar[int]
    DISK_PINNED_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    DISK_INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BLOCKS_FIELD_NUMBER: _ClassVar[int]
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
    leaks_reclaimed: int
    hit_rate_estimates: _containers.RepeatedCompositeFieldContainer[HitRateEstimate]
    host_total: int
    host_free: int
    host_pending: int
    host_cached: int
    host_pinned: int
    demotions: int
    onboards: int
    demotions_dropped: int
    eviction_policy: str
    current_policy: str
    policy_estimates: _containers.RepeatedCompositeFieldContainer[PolicyEstimate]
    policy_switches: int
    fork_shared: int
    fork_copies: int
    disk_total: int
    disk_free: int
    disk_pending: int
    disk_cached: int
    disk_pinned: int
    spills: int
    loads: int
    disk_invalidated: int
    handoff_blocks: int
    def __init__(self, pool_group: _Optional[str] = ..., pool_id: _Optional[int] = ..., window: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., total: _Optional[int] = ..., free: _Optional[int] = ..., cached_evictable: _Optional[int] = ..., in_use: _Optional[int] = ..., fenced: _Optional[int] = ..., grants: _Optional[int] = ..., rejects: _Optional[int] = ..., evictions: _Optional[int] = ..., reuse_lookups: _Optional[int] = ..., reuse_hits: _Optional[int] = ..., leaks_reclaimed: _Optional[int] = ..., hit_rate_estimates: _Optional[_Iterable[_Union[HitRateEstimate, _Mapping]]] = ..., host_total: _Optional[int] = ..., host_free: _Optional[int] = ..., host_pending: _Optional[int] = ..., host_cached: _Optional[int] = ..., host_pinned: _Optional[int] = ..., demotions: _Optional[int] = ..., onboards: _Optional[int] = ..., demotions_dropped: _Optional[int] = ..., eviction_policy: _Optional[str] = ..., current_policy: _Optional[str] = ..., policy_estimates: _Optional[_Iterable[_Union[PolicyEstimate, _Mapping]]] = ..., policy_switches: _Optional[int] = ..., fork_shared: _Optional[int] = ..., fork_copies: _Optional[int] = ..., disk_total: _Optional[int] = ..., disk_free: _Optional[int] = ..., disk_pending: _Optional[int] = ..., disk_cached: _Optional[int] = ..., disk_pinned: _Optional[int] = ..., spills: _Optional[int] = ..., loads: _Optional[int] = ..., disk_invalidated: _Optional[int] = ..., handoff_blocks: _Optional[int] = ...) -> None: ...

class PolicyEstimate(_message.Message):
    __slots__ = ("policy", "hit_rate")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    policy: str
    hit_rate: float
    def __init__(self, policy: _Optional[str] = ..., hit_rate: _Optional[float] = ...) -> None: ...

class HitRateEstimate(_message.Message):
    __slots__ = ("scale", "blocks", "hit_rate", "sampled_lookups")
    SCALE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    scale: float
    blocks: int
    hit_rate: float
    sampled_lookups: int
    def __init__(self, scale: _Optional[float] = ..., blocks: _Optional[int] = ..., hit_rate: _Optional[float] = ..., sampled_lookups: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("pools", "epoch", "sessions", "sequences")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    epoch: int
    sessions: int
    sequences: int
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., epoch: _Optional[int] = ..., sessions: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_id",)
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    after_id: int
    def __init__(self, after_id: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("id", "pool_id", "stored", "removed", "lost", "tier")
    ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    pool_id: int
    stored: BlocksStored
    removed: BlocksRemoved
    lost: EventsLost
    tier: Tier
    def __init__(self, id: _Optional[int] = ..., pool_id: _Optional[int] = ..., stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., lost: _Optional[_Union[EventsLost, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class EventsLost(_message.Message):
    __slots__ = ("oldest_available",)
    OLDEST_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    oldest_available: int
    def __init__(self, oldest_available: _Optional[int] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeakedBlock(_message.Message):
    __slots__ = ("pool_id", "block_id", "last_holder")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_HOLDER_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    block_id: int
    last_holder: str
    def __init__(self, pool_id: _Optional[int] = ..., block_id: _Optional[int] = ..., last_holder: _Optional[str] = ...) -> None: ...

class AuditResponse(_message.Message):
    __slots__ = ("reclaimed", "blocks_checked")
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    reclaimed: _containers.RepeatedCompositeFieldContainer[LeakedBlock]
    blocks_checked: int
    def __init__(self, reclaimed: _Optional[_Iterable[_Union[LeakedBlock, _Mapping]]] = ..., blocks_checked: _Optional[int] = ...) -> None: ...

class MatchPrompt(_message.Message):
    __slots__ = ("prompt_tokens", "cache_salt")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "pool_groups", "prompts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    pool_groups: _containers.RepeatedScalarFieldContainer[str]
    prompts: _containers.RepeatedCompositeFieldContainer[MatchPrompt]
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., pool_groups: _Optional[_Iterable[str]] = ..., prompts: _Optional[_Iterable[_Union[MatchPrompt, _Mapping]]] = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("reused_tokens", "peer_tokens")
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reused_tokens: _containers.RepeatedScalarFieldContainer[int]
    peer_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reused_tokens: _Optional[_Iterable[int]] = ..., peer_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[MatchResult, _Mapping]]] = ...) -> None: ...
