//! Command-line flags, each with an environment fallback.

use std::net::SocketAddr;
use std::time::Duration;

use crate::cache::CacheConfig;
use crate::eviction::{EvictionConfig, PolicyKind, parse_group_policy};

/// Configuration of the cache service.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "kvlease-cache",
    version,
    about = "kvlease cache service: leases paged KV blocks"
)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "KVLEASE_CACHE_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `GET /metrics` endpoint; off when absent.
    #[arg(long, env = "KVLEASE_CACHE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Session TTL when the holder asks for none, in milliseconds.
    #[arg(long, env = "KVLEASE_CACHE_SESSION_TTL_MS", default_value_t = 30_000)]
    pub session_ttl_ms: u64,
    /// Smallest session TTL granted, in milliseconds.
    #[arg(long, env = "KVLEASE_CACHE_MIN_TTL_MS", default_value_t = 1_000)]
    pub min_ttl_ms: u64,
    /// Largest session TTL granted, in milliseconds.
    #[arg(long, env = "KVLEASE_CACHE_MAX_TTL_MS", default_value_t = 600_000)]
    pub max_ttl_ms: u64,
    /// Block references one session may hold; 0 for no quota.
    #[arg(long, env = "KVLEASE_CACHE_SESSION_QUOTA", default_value_t = 0)]
    pub session_quota: u64,
    /// Most sequences in one Lease / Extend / Release / Estimate call.
    #[arg(long, env = "KVLEASE_CACHE_MAX_BATCH", default_value_t = 4096)]
    pub max_batch: usize,
    /// Largest request message, in bytes.
    #[arg(long, env = "KVLEASE_CACHE_MAX_MESSAGE_BYTES", default_value_t = 16 << 20)]
    pub max_message_bytes: usize,
    /// Block-hash events kept for WatchEvents.
    #[arg(long, env = "KVLEASE_CACHE_EVENT_BUFFER", default_value_t = 65_536)]
    pub event_buffer: usize,
    /// How often expired sessions are reclaimed, in milliseconds.
    #[arg(long, env = "KVLEASE_CACHE_EXPIRY_INTERVAL_MS", default_value_t = 500)]
    pub expiry_interval_ms: u64,
    /// How often the leak audit runs, in milliseconds; 0 turns it off.
    #[arg(
        long,
        env = "KVLEASE_CACHE_AUDIT_INTERVAL_MS",
        default_value_t = 60_000
    )]
    pub audit_interval_ms: u64,
    /// Eviction policy of every pool group not named by --group-eviction-policy:
    /// lru, lfu or chain.
    #[arg(long, env = "KVLEASE_CACHE_EVICTION_POLICY", default_value = "lru")]
    pub eviction_policy: PolicyKind,
    /// Eviction policy of one pool group, as GROUP=POLICY; repeatable.
    #[arg(long, value_parser = parse_group_policy)]
    pub group_eviction_policy: Vec<(String, PolicyKind)>,
}

impl Default for Config {
    fn default() -> Self {
        <Self as clap::Parser>::parse_from(["kvlease-cache"])
    }
}

impl Config {
    /// The core's limits and defaults.
    pub fn cache_config(&self) -> CacheConfig {
        CacheConfig {
            default_ttl: Duration::from_millis(self.session_ttl_ms),
            min_ttl: Duration::from_millis(self.min_ttl_ms),
            max_ttl: Duration::from_millis(self.max_ttl_ms.max(self.min_ttl_ms)),
            session_quota: self.session_quota,
            event_capacity: self.event_buffer,
            eviction: EvictionConfig {
                default: self.eviction_policy,
                groups: self.group_eviction_policy.clone(),
            },
            ..CacheConfig::default()
        }
    }

    /// Checks values clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_batch == 0 {
            return Err("--max-batch must be at least 1".into());
        }
        if self.min_ttl_ms == 0 {
            return Err("--min-ttl-ms must be at least 1".into());
        }
        if self.expiry_interval_ms == 0 {
            return Err("--expiry-interval-ms must be at least 1".into());
        }
        if self.max_message_bytes < 1024 {
            return Err("--max-message-bytes must be at least 1024".into());
        }
        Ok(())
    }
}
