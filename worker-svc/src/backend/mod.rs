//! Compute backends: each owns the KV arena's memory and runs a validated
//! [`Batch`]. `cpu` always exists; `cuda` (feature `cuda`) runs the same
//! trait over device memory.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::batch::Batch;
use crate::error::Result;
pub use crate::logits::BatchLogits;
use crate::logprobs::{LogprobRow, RowLogprobs};
use crate::sampling::RowPick;

/// Which backend the worker runs on (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendChoice {
    /// Host memory and CPU threads.
    #[default]
    Cpu,
    /// An NVIDIA GPU; fails with a clear error when there is none (or when
    /// the binary was built without the `cuda` feature).
    Cuda,
    /// CUDA when a device and libcuda are present, else CPU.
    Auto,
}

/// Element type of the device KV arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvDtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    #[default]
    Bf16,
    /// fp8 e4m3 (OCP FP8: 4 exponent bits, 3 mantissa bits, no infinities),
    /// stored without a scale: values round to nearest even and saturate at
    /// ±448. Half the bytes of the 16-bit types, so twice the blocks in the
    /// same memory; needs a GPU of compute capability 8.9 or newer.
    Fp8,
}

impl KvDtype {
    /// Name as `Describe` reports it.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8_e4m3",
        }
    }

    /// Bytes of one element.
    pub fn elem_bytes(self) -> u64 {
        match self {
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// Element `i` of K/V bytes of this type (little-endian), as f32.
    ///
    /// # Panics
    /// When `bytes` is too short to hold element `i`.
    pub fn value(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            KvDtype::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            KvDtype::Bf16 => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            KvDtype::Fp8 => e4m3_to_f32(bytes[i]),
        }
    }
}

/// An fp8 e4m3 value as f32: exponent bias 7, subnormals below 2^-6, one
/// NaN encoding per sign (every exponent and mantissa bit set).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mantissa) = (i32::from((b >> 3) & 0x0f), f32::from(b & 0x07));
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// How the CUDA backend is set up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: usize,
    /// Element type of the arena.
    pub kv_dtype: KvDtype,
    /// Share of the device memory left free after weights and activations
    /// that the arena takes, in (0, 1].
    pub memory_fraction: f64,
    /// Upper bound on the arena's bytes; 0 = none.
    pub max_kv_bytes: u64,
    /// Decode passes (one token per sequence, up to 256 sequences) replayed
    /// from CUDA graphs captured per batch-size bucket, instead of launched
    /// one kernel at a time; the same bits either way.
    pub decode_graphs: bool,
    /// Streams the row tiles of a long product (a prefill's) run on at
    /// once, each tile the same fixed-shape call whatever the count.
    pub gemm_streams: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            kv_dtype: KvDtype::Bf16,
            memory_fraction: 0.9,
            max_kv_bytes: 0,
            decode_graphs: true,
            gemm_streams: 4,
        }
    }
}

/// Device time of one profiled forward pass, by kind of work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// Matrix products (projections, MLP, LM head).
    pub matmul_ms: f64,
    /// Paged attention and the merge of its splits.
    pub attention_ms: f64,
    /// Everything else: embedding, norms, RoPE, K/V scatter, SwiGLU.
    pub other_ms: f64,
    /// Host wall time of the same pass, by stage.
    pub host: HostTimes,
}

/// Host wall time of one profiled pass, by stage, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostTimes {
    /// Checking the batch against the model, the tables and the slot ledger.
    pub validate_ms: f64,
    /// Building the per-row metadata and uploading it.
    pub upload_ms: f64,
    /// Enqueueing the kernels and products.
    pub launch_ms: f64,
    /// Waiting for the device and copying the logits back.
    pub download_ms: f64,
    /// Sampling and building the per-sequence outputs.
    pub outputs_ms: f64,
}

/// What [`Backend::forward_picks`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    /// One token per logits row.
    pub tokens: Vec<u32>,
    /// One per [`LogprobRow`] asked for, in that order.
    pub logprobs: Vec<RowLogprobs>,
}

/// A token of a pass taken on the device from the pass begun before it:
/// the token at `token` (index into the batch's tokens, in batch order)
/// is the argmax of that pass's logit row `row`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feed {
    /// Index of the token in the batch being begun.
    pub token: u32,
    /// Logit row of the previous pass whose argmax it is.
    pub row: u32,
}

/// The tokens of a begun pass ([`Backend::begin_argmax`]): at hand, or on
/// their way back from a device.
pub struct PendingTokens(Pending);

enum Pending {
    Ready(Vec<u32>),
    OnDevice(Box<dyn FnOnce() -> Result<Vec<u32>> + Send>),
}

impl PendingTokens {
    /// Tokens already computed.
    pub fn ready(tokens: Vec<u32>) -> Self {
        PendingTokens(Pending::Ready(tokens))
    }

    /// Tokens that `wait` brings back from the device (blocking until the
    /// pass and every pass begun before it finished).
    pub fn on_device(wait: impl FnOnce() -> Result<Vec<u32>> + Send + 'static) -> Self {
        PendingTokens(Pending::OnDevice(Box::new(wait)))
    }

    /// Whether the tokens are still on the device, where the pass begun
    /// next can be fed from them.
    pub fn is_on_device(&self) -> bool {
        matches!(self.0, Pending::OnDevice(_))
    }

    /// The tokens, one per logit row, once the pass finished.
    pub fn wait(self) -> Result<Vec<u32>> {
        match self.0 {
            Pending::Ready(tokens) => Ok(tokens),
            Pending::OnDevice(wait) => wait(),
        }
    }
}

impl std::fmt::Debug for PendingTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Pending::Ready(t) => write!(f, "PendingTokens::Ready({} tokens)", t.len()),
            Pending::OnDevice(_) => f.write_str("PendingTokens::OnDevice"),
        }
    }
}

/// A compute backend for the forward pass.
pub trait Backend: Send + std::fmt::Debug {
    /// Short name: "cpu" or "cuda".
    fn name(&self) -> &'static str;
    /// Device description, e.g. the CPU model.
    fn device(&self) -> String;
    /// Element type of the KV arena: "f32", "f16" or "bf16".
    fn kv_dtype(&self) -> &'static str;
    /// Writes the K/V of every token of `batch` into its slots, then attends
    /// and returns the logits rows. `batch` has been validated against the
    /// arena layout this backend was built with.
    fn forward(&mut self, batch: &Batch) -> Result<BatchLogits>;
    /// Runs `batch` as [`Backend::forward`] does, but returns only one token
    /// per logits row `forward` would return: the row's pick where `picks`
    /// has one ([`crate::sampling`]), else its argmax (first index of the
    /// largest value, as [`crate::ops::argmax`]), so a backend whose logits
    /// live in device memory samples there and copies back one token per
    /// row instead of the row. With `logprobs`, also the log-probabilities
    /// each of those rows asks for ([`crate::logprobs`]: of the raw logits,
    /// before the picks' adjustments), computed where the logits are, so
    /// only those values come back. `feed` is as for
    /// [`Backend::begin_argmax`] (no pick depends on a fed token). The
    /// default picks on the host from
    /// `forward`'s rows and has no device tokens to feed from.
    fn forward_picks(
        &mut self,
        batch: &Batch,
        feed: &[Feed],
        picks: &[RowPick],
        logprobs: &[LogprobRow],
    ) -> Result<Picked> {
        if !feed.is_empty() {
            return Err(crate::error::Error::Backend(format!(
                "the {} backend keeps no sampled tokens on a device to feed from",
                self.name()
            )));
        }
        let logits = self.forward(batch)?;
        let tokens = crate::sampling::pick_rows(&logits, picks);
        let logprobs = crate::logprobs::batch_logprobs(&logits, &tokens, logprobs)?;
        Ok(Picked { tokens, logprobs })
    }
    /// Starts a batch whose every row takes its argmax, as
    /// [`Backend::forward_picks`] runs it with no picks, and returns
    /// before its tokens are back: they come from [`PendingTokens::wait`],
    /// which needs no access to the backend, so the next pass can be
    /// started (and its host work done) while this one runs. `feed` lists
    /// tokens of `batch` to take on the device from the argmax of the pass
    /// begun just before this one ([`Feed`]); their tokens in `batch` are
    /// placeholders. The default runs the pass at once and has no device
    /// tokens to feed from.
    fn begin_argmax(&mut self, batch: &Batch, feed: &[Feed]) -> Result<PendingTokens> {
        Ok(PendingTokens::ready(
            self.forward_picks(batch, feed, &[], &[])?.tokens,
        ))
    }
    /// Gives the backend a host tier of `host_blocks[i]` blocks for pool
    /// `i` (a second arena in host memory). A backend that has none refuses
    /// with a clear error, so a worker started with a tier never silently
    /// runs without one.
    fn set_host_tier(&mut self, host_blocks: &[u32]) -> Result<()> {
        if host_blocks.iter().all(|&n| n == 0) {
            return Ok(());
        }
        Err(crate::error::Error::Config(format!(
            "the {} backend has no host-memory tier yet; start it without --host-blocks",
            self.name()
        )))
    }
    /// Copies whole blocks between the device arena and the host tier, in
    /// the order given (validated against both), and returns once they are
    /// done: a pass after it sees the onboarded blocks, and its writes do
    /// not overtake a demotion.
    fn tier_copies(&mut self, moves: &[crate::batch::TierMove]) -> Result<()> {
        if moves.is_empty() {
            return Ok(());
        }
        Err(crate::error::Error::Backend(format!(
            "the {} backend has no host-memory tier",
            self.name()
        )))
    }
    /// Whether the backend can read host blocks and write device blocks
    /// as bytes ([`Backend::host_block_bytes`],
    /// [`Backend::write_device_block`]), which the disk tier needs.
    fn supports_disk_tier(&self) -> bool {
        false
    }
    /// The bytes of host block `host_block` of pool `pool` (its K/V as the
    /// backend keeps it), for a spill to the disk tier.
    fn host_block_bytes(&self, _pool: usize, _host_block: u32) -> Result<Vec<u8>> {
        Err(crate::error::Error::Backend(format!(
            "the {} backend has no disk tier",
            self.name()
        )))
    }
    /// The bytes of device block `block` of pool `pool` (its K/V as the
    /// backend keeps it, as [`Backend::host_block_bytes`] gives a host
    /// block's), for a peer pull; [`Backend::write_device_block`] of the
    /// same backend kind takes them back.
    fn device_block_bytes(&self, _pool: usize, _block: u32) -> Result<Vec<u8>> {
        Err(crate::error::Error::Backend(format!(
            "the {} backend cannot serve peer pulls yet",
            self.name()
        )))
    }
    /// Writes `bytes` (from [`Backend::host_block_bytes`] of the same
    /// backend kind) into device block `device_block` of pool `pool`, for a
    /// load from the disk tier; returns once a later pass sees them.
    fn write_device_block(
        &mut self,
        _pool: usize,
        _device_block: u32,
        _bytes: &[u8],
    ) -> Result<()> {
        Err(crate::error::Error::Backend(format!(
            "the {} backend has no disk tier",
            self.name()
        )))
    }
    /// Turns per-phase timing of later passes on or off; backends that
    /// cannot time phases ignore it.
    fn set_profiling(&mut self, _on: bool) {}
    /// Phase times of the last pass run with profiling on, if the backend
    /// times phases.
    fn last_profile(&self) -> Option<PhaseTimes> {
        None
    }

    /// Passes captured into graphs and passes replayed from them so far
    /// (CUDA decode graphs; zero for backends without graphs).
    fn graph_counts(&self) -> GraphCounts {
        GraphCounts::default()
    }
}

/// What [`Backend::graph_counts`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Graphs captured (a capture per row bucket and split plan, again
    /// after the metadata buffers grew).
    pub captures: u64,
    /// Passes replayed from a graph.
    pub replays: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values_decode_as_the_format_defines_them() {
        // (bits, value): zero, the smallest subnormal, the largest
        // subnormal, the smallest normal, one, 1.125, the largest finite,
        // negatives
        let cases = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x7e, 448.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
        ];
        for (bits, want) in cases {
            assert_eq!(e4m3_to_f32(bits), want, "{bits:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // every other encoding is finite: e4m3 has no infinities
        assert_eq!((0..=255u8).filter(|b| e4m3_to_f32(*b).is_nan()).count(), 2);
    }

    #[test]
    fn elements_decode_little_endian_at_their_width() {
        let bf16 = half::bf16::from_f32(-2.5).to_le_bytes();
        let f16 = half::f16::from_f32(0.375).to_le_bytes();
        assert_eq!(KvDtype::Bf16.value(&[0, 0, bf16[0], bf16[1]], 1), -2.5);
        assert_eq!(KvDtype::F16.value(&f16, 0), 0.375);
        assert_eq!(KvDtype::Fp8.value(&[0x00, 0x38, 0x7e], 1), 1.0);
        assert_eq!(
            [KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8].map(KvDtype::elem_bytes),
            [2, 2, 1]
        );
    }
}
