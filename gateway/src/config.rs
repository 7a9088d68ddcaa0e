//! The gateway's configuration: flags with environment fallbacks.

use std::net::SocketAddr;

use kvlease_runtime::process::{ListenAddrs, ServiceConfig};

/// Where the gateway listens, which scheduler it fronts and the model name
/// it answers to.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvlease-gateway",
    about = "kvlease's OpenAI-compatible HTTP front"
)]
pub struct Config {
    /// Address the HTTP server listens on.
    #[arg(long, env = "KVLEASE_GATEWAY_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Transport security: mTLS material, `--insecure`, accepted bearer tokens.
    #[command(flatten)]
    pub security: kvlease_auth::SecurityArgs,
    /// The scheduler's gRPC endpoint.
    #[arg(
        long,
        env = "KVLEASE_GATEWAY_SCHEDULER_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub scheduler_addr: String,
    /// The model id `/v1/models` lists and requests must name.
    #[arg(long, env = "KVLEASE_GATEWAY_MODEL", default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Other ids requests may name for the same model (comma-separated);
    /// `/v1/models` lists them after --model, answers name --model.
    #[arg(long, env = "KVLEASE_GATEWAY_MODEL_ALIASES", value_delimiter = ',')]
    pub model_aliases: Vec<String>,
    /// `max_tokens` of a request that gives none (OpenAI's completions
    /// default is 16; chat has no default there, so one is needed here).
    #[arg(
        long,
        env = "KVLEASE_GATEWAY_DEFAULT_MAX_TOKENS",
        default_value_t = 256
    )]
    pub default_max_tokens: u32,
    /// Transport limits (connections, keepalive, streams). A connection
    /// proves itself (leaves the evictable pool, stops the handshake
    /// deadline) only by a request whose headers arrived whole.
    #[command(flatten)]
    pub limits: kvlease_runtime::limits::ServeLimits,
    /// Milliseconds a request's body may take to arrive whole (408 after).
    #[arg(long, env = "KVLEASE_GATEWAY_BODY_TIMEOUT_MS", default_value_t = DEFAULT_BODY_TIMEOUT_MS)]
    pub body_timeout_ms: u64,
}

/// The default of `--body-timeout-ms`.
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 10_000;

/// The model id when none is configured.
pub const DEFAULT_MODEL: &str = "kvlease";

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            security: kvlease_auth::SecurityArgs::default(),
            scheduler_addr: "http://127.0.0.1:50051".into(),
            model: DEFAULT_MODEL.into(),
            model_aliases: Vec::new(),
            default_max_tokens: 256,
            limits: Default::default(),
            body_timeout_ms: DEFAULT_BODY_TIMEOUT_MS,
        }
    }
}

impl ServiceConfig for Config {
    const LISTENER: &'static str = "http";

    fn listen_addrs(&self) -> Result<ListenAddrs, String> {
        // no metrics endpoint of its own
        ListenAddrs::checked(self.validate(), self.listen, None)
    }
}

impl Config {
    /// Checks what clap cannot: a usable scheduler URL and model name.
    pub fn validate(&self) -> Result<(), String> {
        if self.model.trim().is_empty() {
            return Err("--model must not be empty".into());
        }
        if self.model_aliases.iter().any(|a| a.trim().is_empty()) {
            return Err("--model-aliases must not hold an empty name".into());
        }
        if self.default_max_tokens == 0 {
            return Err("--default-max-tokens must be at least 1".into());
        }
        self.limits.validate()?;
        if self.body_timeout_ms == 0 {
            return Err("--body-timeout-ms must be at least 1".into());
        }
        kvlease_auth::Security::loopback()
            .endpoint(
                &self.scheduler_addr,
                Some(kvlease_auth::ServiceKind::Scheduler),
            )
            .map(|_| ())
            .map_err(|e| format!("invalid --scheduler-addr {:?}: {e}", self.scheduler_addr))
    }
}
