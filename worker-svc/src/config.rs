//! The worker's configuration: flags with `KVLEASE_WORKER_*` environment
//! fallbacks, and a `Default` that is the small CI model. Each default is one
//! const that both clap and [`Default`] use.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use kvlease_runtime::process::{ListenAddrs, ServiceConfig};

use crate::backend::{BackendChoice, CudaOptions, KvDtype};
use crate::batch::Limits;
use crate::error::{Error, Result};
use crate::model::load::{self, LoadedModel, ServingShape};
use crate::model::tokenizer::VOCAB_SIZE;
use crate::model::weights::Weights;
use crate::model::{ModelConfig, RopeScaling};
use crate::worker::WorkerOptions;

const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 50053);
const DEFAULT_SEED: u64 = 0;
const DEFAULT_VOCAB_SIZE: usize = VOCAB_SIZE as usize;
const DEFAULT_THREADS: usize = 0;
const DEFAULT_BACKEND: BackendChoice = BackendChoice::Cpu;
const DEFAULT_KV_DTYPE: KvDtype = KvDtype::Bf16;
const DEFAULT_GPU_DEVICE: usize = 0;
const DEFAULT_GPU_MEMORY_FRACTION: f64 = 0.9;
const DEFAULT_GPU_MAX_KV_MIB: u64 = 0;
const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;
const DEFAULT_HIDDEN: usize = 256;
const DEFAULT_LAYERS: usize = 4;
const DEFAULT_HEADS: usize = 8;
const DEFAULT_KV_HEADS: usize = 2;
const DEFAULT_HEAD_DIM: usize = 32;
const DEFAULT_FFN: usize = 768;
const DEFAULT_ROPE_THETA: f32 = 10_000.0;
const DEFAULT_RMS_EPS: f32 = 1e-5;
const DEFAULT_MAX_CONTEXT: u32 = 2048;
const DEFAULT_TOKENS_PER_BLOCK: u32 = 16;
const DEFAULT_MEMORY_BUDGET_MIB: u64 = 64;
const DEFAULT_MAX_BATCH_SEQUENCES: usize = 64;
const DEFAULT_MAX_BATCH_TOKENS: usize = 1024;

fn default_windows() -> Vec<u32> {
    vec![0, 64, 0, 64]
}

/// Configuration of one worker.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "kvlease-worker",
    version,
    about = "kvlease worker: a Llama-style model over leased KV blocks"
)]
pub struct Config {
    /// Address the gRPC server listens on.
    #[arg(long, env = "KVLEASE_WORKER_LISTEN", default_value_t = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Transport security: mTLS material, `--insecure`, accepted bearer tokens.
    #[command(flatten)]
    pub security: kvlease_auth::SecurityArgs,
    /// The principal whose Forward calls this worker serves (the scheduler of its pool
    /// group). Required under TLS or a token file, unless --owner-first-caller.
    #[arg(
        long,
        env = "KVLEASE_WORKER_OWNER",
        conflicts_with = "owner_first_caller"
    )]
    pub owner: Option<String>,
    /// Without --owner under TLS or a token file: let the first authenticated principal
    /// that calls Forward own this worker (first come, first owner; opt in knowingly).
    #[arg(long, env = "KVLEASE_WORKER_OWNER_FIRST_CALLER")]
    pub owner_first_caller: bool,

    /// A real model: a GGUF file (architecture llama) or a Hugging Face
    /// directory (config.json, safetensors, tokenizer.json). Its shape
    /// comes from the file; the shape flags are ignored. Without it the
    /// seeded model runs.
    #[arg(long, env = "KVLEASE_WORKER_MODEL", conflicts_with = "weights")]
    pub model: Option<PathBuf>,

    /// Safetensors file with HF Llama tensor names; weights are drawn from
    /// `--seed` when absent. Shapes must match the model flags.
    #[arg(long, env = "KVLEASE_WORKER_WEIGHTS")]
    pub weights: Option<PathBuf>,

    /// Seed of the deterministic weights (when no file is given).
    #[arg(long, env = "KVLEASE_WORKER_SEED", default_value_t = DEFAULT_SEED)]
    pub seed: u64,

    /// Vocabulary size (258 = 256 bytes + BOS 256 + EOS 257).
    #[arg(long, env = "KVLEASE_WORKER_VOCAB_SIZE", default_value_t = DEFAULT_VOCAB_SIZE)]
    pub vocab_size: usize,

    /// Width of the residual stream.
    #[arg(long, env = "KVLEASE_WORKER_HIDDEN_SIZE", default_value_t = DEFAULT_HIDDEN)]
    pub hidden_size: usize,

    /// Decoder layers.
    #[arg(long, env = "KVLEASE_WORKER_NUM_LAYERS", default_value_t = DEFAULT_LAYERS)]
    pub num_layers: usize,

    /// Query heads.
    #[arg(long, env = "KVLEASE_WORKER_NUM_HEADS", default_value_t = DEFAULT_HEADS)]
    pub num_heads: usize,

    /// Key/value heads (grouped-query attention).
    #[arg(long, env = "KVLEASE_WORKER_NUM_KV_HEADS", default_value_t = DEFAULT_KV_HEADS)]
    pub num_kv_heads: usize,

    /// Width of one head.
    #[arg(long, env = "KVLEASE_WORKER_HEAD_DIM", default_value_t = DEFAULT_HEAD_DIM)]
    pub head_dim: usize,

    /// Width of the SwiGLU feed-forward layer.
    #[arg(long, env = "KVLEASE_WORKER_FFN_SIZE", default_value_t = DEFAULT_FFN)]
    pub ffn_size: usize,

    /// RoPE base frequency.
    #[arg(long, env = "KVLEASE_WORKER_ROPE_THETA", default_value_t = DEFAULT_ROPE_THETA)]
    pub rope_theta: f32,

    /// RMSNorm epsilon.
    #[arg(long, env = "KVLEASE_WORKER_RMS_NORM_EPS", default_value_t = DEFAULT_RMS_EPS)]
    pub rms_norm_eps: f32,

    /// Attention window per layer, comma-separated (0 = full attention); one
    /// value applies to every layer.
    #[arg(
        long,
        env = "KVLEASE_WORKER_LAYER_WINDOWS",
        value_delimiter = ',',
        default_values_t = default_windows()
    )]
    pub layer_windows: Vec<u32>,

    /// Largest context (prompt + output) in tokens.
    #[arg(long, env = "KVLEASE_WORKER_MAX_CONTEXT", default_value_t = DEFAULT_MAX_CONTEXT)]
    pub max_context: u32,

    /// Tokens per KV block.
    #[arg(long, env = "KVLEASE_WORKER_TOKENS_PER_BLOCK", default_value_t = DEFAULT_TOKENS_PER_BLOCK)]
    pub tokens_per_block: u32,

    /// Give seeded weights a separate LM head instead of tying it to the embedding.
    #[arg(long, env = "KVLEASE_WORKER_UNTIED_LM_HEAD")]
    pub untied_lm_head: bool,

    /// Memory for weights, activations and KV blocks together, in MiB.
    #[arg(long, env = "KVLEASE_WORKER_MEMORY_BUDGET_MIB", default_value_t = DEFAULT_MEMORY_BUDGET_MIB)]
    pub memory_budget_mib: u64,

    /// Most sequences in one Forward.
    #[arg(long, env = "KVLEASE_WORKER_MAX_BATCH_SEQUENCES", default_value_t = DEFAULT_MAX_BATCH_SEQUENCES)]
    pub max_batch_sequences: usize,

    /// Most input tokens in one Forward, all sequences together.
    #[arg(long, env = "KVLEASE_WORKER_MAX_BATCH_TOKENS", default_value_t = DEFAULT_MAX_BATCH_TOKENS)]
    pub max_batch_tokens: usize,

    /// Compute threads; 0 = one per available core, at most 8.
    #[arg(long, env = "KVLEASE_WORKER_THREADS", default_value_t = DEFAULT_THREADS)]
    pub threads: usize,

    /// Blocks of a host-memory tier per pool, where the cache keeps blocks
    /// it evicts from the pool and brings back on a prefix hit; 0 = no
    /// tier. Outside the memory budget; on the cuda backend it is pinned
    /// (page-locked) host memory.
    #[arg(long, env = "KVLEASE_WORKER_HOST_BLOCKS", default_value_t = 0)]
    pub host_blocks: u32,

    /// Directory of a file-backed disk tier below the host tier (needs
    /// --host-blocks and --disk-tier-bytes): one file per block, with a
    /// checksum and the model's fingerprint, kept across restarts (a
    /// restarted worker announces the files that verify). One directory
    /// per worker; the cpu backend only.
    #[arg(
        long,
        env = "KVLEASE_WORKER_DISK_TIER_DIR",
        requires = "disk_tier_bytes"
    )]
    pub disk_tier_dir: Option<PathBuf>,

    /// Size cap of the disk tier in bytes: as many blocks of every pool as
    /// fit (headers included).
    #[arg(
        long,
        env = "KVLEASE_WORKER_DISK_TIER_BYTES",
        requires = "disk_tier_dir"
    )]
    pub disk_tier_bytes: Option<u64>,

    /// Address of the Prometheus `GET /metrics` endpoint; off when absent.
    #[arg(long, env = "KVLEASE_WORKER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Compute backend: cpu, cuda (fails clearly without a device), or auto
    /// (cuda when a device and libcuda are present, else cpu).
    #[arg(long, env = "KVLEASE_WORKER_BACKEND", value_enum, default_value_t = DEFAULT_BACKEND)]
    pub backend: BackendChoice,

    /// Element type of the KV arena on the GPU (the CPU arena is f32).
    #[arg(long, env = "KVLEASE_WORKER_KV_DTYPE", value_enum, default_value_t = DEFAULT_KV_DTYPE)]
    pub kv_dtype: KvDtype,

    /// CUDA device ordinal.
    #[arg(long, env = "KVLEASE_WORKER_GPU_DEVICE", default_value_t = DEFAULT_GPU_DEVICE)]
    pub gpu_device: usize,

    /// Share of the device memory free after weights and activations that
    /// the GPU arena takes, in (0, 1].
    #[arg(
        long,
        env = "KVLEASE_WORKER_GPU_MEMORY_FRACTION",
        default_value_t = DEFAULT_GPU_MEMORY_FRACTION
    )]
    pub gpu_memory_fraction: f64,

    /// Upper bound on the GPU arena in MiB; 0 = only the fraction limits it.
    #[arg(long, env = "KVLEASE_WORKER_GPU_MAX_KV_MIB", default_value_t = DEFAULT_GPU_MAX_KV_MIB)]
    pub gpu_max_kv_mib: u64,
    /// Largest request message (a Forward batch), in bytes; a larger one is
    /// refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVLEASE_WORKER_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Transport limits (connections, keepalive, streams).
    #[command(flatten)]
    pub limits: kvlease_runtime::limits::ServeLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN,
            security: kvlease_auth::SecurityArgs::default(),
            owner: None,
            owner_first_caller: false,
            model: None,
            weights: None,
            seed: DEFAULT_SEED,
            vocab_size: DEFAULT_VOCAB_SIZE,
            hidden_size: DEFAULT_HIDDEN,
            num_layers: DEFAULT_LAYERS,
            num_heads: DEFAULT_HEADS,
            num_kv_heads: DEFAULT_KV_HEADS,
            head_dim: DEFAULT_HEAD_DIM,
            ffn_size: DEFAULT_FFN,
            rope_theta: DEFAULT_ROPE_THETA,
            rms_norm_eps: DEFAULT_RMS_EPS,
            layer_windows: default_windows(),
            max_context: DEFAULT_MAX_CONTEXT,
            tokens_per_block: DEFAULT_TOKENS_PER_BLOCK,
            untied_lm_head: false,
            memory_budget_mib: DEFAULT_MEMORY_BUDGET_MIB,
            max_batch_sequences: DEFAULT_MAX_BATCH_SEQUENCES,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            threads: DEFAULT_THREADS,
            host_blocks: 0,
            disk_tier_dir: None,
            disk_tier_bytes: None,
            metrics_listen: None,
            backend: DEFAULT_BACKEND,
            kv_dtype: DEFAULT_KV_DTYPE,
            gpu_device: DEFAULT_GPU_DEVICE,
            gpu_memory_fraction: DEFAULT_GPU_MEMORY_FRACTION,
            gpu_max_kv_mib: DEFAULT_GPU_MAX_KV_MIB,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            limits: Default::default(),
        }
    }
}

impl ServiceConfig for Config {
    fn listen_addrs(&self) -> std::result::Result<ListenAddrs, String> {
        ListenAddrs::checked(self.validate(), self.listen, self.metrics_listen)
    }
}

impl Config {
    /// Checks what can be checked before anything is built: the model shape.
    pub fn validate(&self) -> Result<()> {
        if self.max_message_bytes < 1024 {
            return Err(Error::Config(
                "max_message_bytes must be at least 1024".into(),
            ));
        }
        self.limits.validate().map_err(Error::Config)?;
        self.check_owner()?;
        self.model_config().map(drop)
    }

    /// A secured worker names its owner, or says that the first caller owns it (issue 29,
    /// finding 7: first come was the silent default). A plaintext worker's callers are all
    /// the one anonymous loopback principal, so there first come is no choice at all.
    pub(crate) fn check_owner(&self) -> Result<()> {
        let secured = self.security.tls_cert.is_some() || self.security.token_file.is_some();
        if secured && self.owner.is_none() && !self.owner_first_caller {
            return Err(Error::Config(
                "--owner is required under TLS or a token file: name the principal of the \
                 scheduler this worker serves, or give --owner-first-caller to let the first \
                 principal that calls Forward own it"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The model shape the flags describe.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let layer_windows = match self.layer_windows.as_slice() {
            [w] => vec![*w; self.num_layers],
            ws if ws.len() == self.num_layers => ws.to_vec(),
            ws => {
                return Err(Error::Config(format!(
                    "layer_windows has {} entries but num_layers is {}",
                    ws.len(),
                    self.num_layers
                )));
            }
        };
        let name = match &self.weights {
            Some(_) => String::new(),
            None => format!("seeded-{}", self.seed),
        };
        let config = ModelConfig {
            name,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            ffn_size: self.ffn_size,
            rope_theta: self.rope_theta,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: self.rms_norm_eps,
            layer_windows,
            max_context: self.max_context,
            tokens_per_block: self.tokens_per_block,
            tied_embeddings: !self.untied_lm_head,
            arch: Default::default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// The weights: read from `--model` or `--weights`, or drawn from `--seed`.
    pub fn load_weights(&self) -> Result<Weights> {
        if let Some(path) = &self.model {
            return Ok(self.load_model(path)?.weights);
        }
        let config = self.model_config()?;
        match &self.weights {
            Some(path) => Weights::load_safetensors(config, path),
            None => Weights::seeded(config, self.seed),
        }
    }

    /// The model at `path` with this config's context and block size.
    pub fn load_model(&self, path: &std::path::Path) -> Result<LoadedModel> {
        load::open(path, self.serving_shape())
    }

    /// The shape of the model this config serves: the `--model` file's
    /// (read from its metadata, weights left on disk), else the flags'.
    pub fn model_shape(&self) -> Result<ModelConfig> {
        match &self.model {
            Some(path) => load::shape(path, self.serving_shape()),
            None => self.model_config(),
        }
    }

    /// Bytes the weights take in the worker's memory: the model file loaded
    /// as the worker loads it (quantized matrices stay packed), or the
    /// seeded model's f32 parameters.
    pub fn weight_bytes(&self) -> Result<u64> {
        match &self.model {
            Some(path) => Ok(load::open(path, self.serving_shape())?.weights.bytes()),
            None => Ok(self.model_config()?.num_params() as u64 * 4),
        }
    }

    fn serving_shape(&self) -> ServingShape {
        ServingShape {
            max_context: self.max_context,
            tokens_per_block: self.tokens_per_block,
        }
    }

    /// Device, arena type and memory share of the CUDA backend.
    pub fn cuda_options(&self) -> CudaOptions {
        CudaOptions {
            device: self.gpu_device,
            kv_dtype: self.kv_dtype,
            memory_fraction: self.gpu_memory_fraction,
            max_kv_bytes: self.gpu_max_kv_mib.saturating_mul(1 << 20),
            ..CudaOptions::default()
        }
    }

    /// Budget, limits and threads.
    pub fn worker_options(&self) -> WorkerOptions {
        WorkerOptions {
            memory_budget_bytes: self.memory_budget_mib.saturating_mul(1 << 20),
            limits: Limits {
                max_batch_sequences: self.max_batch_sequences,
                max_batch_tokens: self.max_batch_tokens,
            },
            threads: self.threads,
            host_blocks: self.host_blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use kvlease_runtime::process::parse_without_env;

    use super::*;

    #[test]
    fn default_is_what_the_flags_give_with_no_flags_and_no_environment() {
        let parsed = parse_without_env::<Config, _, _>("kvlease-worker", ["kvlease-worker"]);
        assert_eq!(parsed.map_err(|e| e.to_string()), Ok(Config::default()));
        assert!(Config::default().validate().is_ok());
        let secured = Config {
            security: kvlease_auth::SecurityArgs {
                tls_cert: Some("w.pem".into()),
                tls_key: Some("w.key".into()),
                tls_ca: Some("ca.pem".into()),
                ..Default::default()
            },
            ..Config::default()
        };
        let e = secured.validate().unwrap_err().to_string();
        assert!(e.contains("--owner is required"), "{e}");
        let named = Config {
            owner: Some("scheduler".into()),
            ..secured.clone()
        };
        assert!(named.validate().is_ok());
        let first_come = Config {
            owner_first_caller: true,
            ..secured
        };
        assert!(first_come.validate().is_ok());
    }
}
