//! The metric names and labels kvlease services expose, in one place so that services,
//! dashboards and the metrics test agree. Counters end in `_total`, durations are seconds.

/// Gauge, labels [`POOL_ID`], [`WINDOW`], [`STATE`]: blocks of a pool in each state
/// ([`STATE_FREE`], [`STATE_CACHED`], [`STATE_IN_USE`], [`STATE_FENCED`]); the states sum to
/// [`POOL_BLOCKS_TOTAL`].
pub const POOL_BLOCKS: &str = "kvlease_pool_blocks";
/// Gauge, labels [`POOL_ID`], [`WINDOW`]: a pool's total blocks.
pub const POOL_BLOCKS_TOTAL: &str = "kvlease_pool_blocks_total";
/// Counter, label [`OP`] (`lease`, `extend`): sequences granted.
pub const GRANTS_TOTAL: &str = "kvlease_grants_total";
/// Counter, labels [`OP`], [`REASON`] (`POOL_EXHAUSTED`, ...): sequences rejected.
pub const REJECTS_TOTAL: &str = "kvlease_rejects_total";
/// Counter, label [`POOL_ID`]: cached blocks evicted.
pub const EVICTIONS_TOTAL: &str = "kvlease_evictions_total";
/// Counter: blocks served from the prefix cache (warm-up excluded).
pub const REUSE_HIT_BLOCKS_TOTAL: &str = "kvlease_reuse_hit_blocks_total";
/// Counter: full prompt blocks looked up in the prefix cache (warm-up excluded).
pub const REUSE_LOOKUP_BLOCKS_TOTAL: &str = "kvlease_reuse_lookup_blocks_total";
/// Gauge: hits / lookups so far (0 before any lookup).
pub const REUSE_HIT_RATE: &str = "kvlease_reuse_hit_rate";
/// Gauge: the prefix hit rate a pool would have at `scale` times its size
/// (the cache's online miss-ratio curve).
pub const ESTIMATED_HIT_RATE: &str = "kvlease_cache_estimated_hit_rate";
/// Counter: blocks the leak audit reclaimed.
pub const LEAKED_BLOCKS_RECLAIMED_TOTAL: &str = "kvlease_leaked_blocks_reclaimed_total";
/// Histogram: one scheduler step, schedule to `CompleteStep`.
pub const STEP_DURATION_SECONDS: &str = "kvlease_step_duration_seconds";
/// Histogram: one worker `Forward` call.
pub const FORWARD_DURATION_SECONDS: &str = "kvlease_forward_duration_seconds";
/// Gauge: requests waiting in the scheduler's queue.
pub const QUEUE_DEPTH: &str = "kvlease_queue_depth";
/// Gauge: sequences running in the current batch.
pub const RUNNING_SEQUENCES: &str = "kvlease_running_sequences";

/// Label: pool id.
pub const POOL_ID: &str = "pool_id";
/// Label: a pool size as a multiple of the real one.
pub const SCALE: &str = "scale";
/// Label: the pool's window in tokens (`0` = full attention).
pub const WINDOW: &str = "window";
/// Label: block state.
pub const STATE: &str = "state";
/// Label: which call (`lease`, `extend`).
pub const OP: &str = "op";
/// Label: reject reason.
pub const REASON: &str = "reason";

/// [`STATE`] value: free blocks.
pub const STATE_FREE: &str = "free";
/// [`STATE`] value: released full blocks kept for reuse, evictable.
pub const STATE_CACHED: &str = "cached";
/// [`STATE`] value: blocks held by leases.
pub const STATE_IN_USE: &str = "in_use";
/// [`STATE`] value: released blocks waiting for their fence step.
pub const STATE_FENCED: &str = "fenced";
