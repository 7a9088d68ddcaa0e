//! The host tier of the CUDA backend: one page-locked (pinned) host array
//! per pool, in the device arena's block layout, and the whole-block copies
//! between the two.
//!
//! Both hold bytes: elements of the arena's type (2 bytes for f16 and bf16,
//! 1 for fp8). A block is contiguous in both arrays (`arena` module:
//! block-major), so a copy is one DMA of the block's bytes, and a run of moves whose
//! device and host blocks both ascend by one is one DMA of the run. Pinned
//! memory is what lets the copy engine move it at the link's rate and
//! without a staging copy through the driver's own pinned buffer.
//!
//! Ordering is the stream's: the copies go on the backend's one stream
//! ahead of the pass that follows, so a demotion reads a device block before
//! that pass's K/V scatter can overwrite it, and an onboarding lands before
//! its attention reads it. [`HostTier::copy`] waits for them before it
//! returns, so an answered Forward never leaves a demotion in flight that
//! the cache would count as written (the next pass's metadata upload, a
//! pageable copy on the same stream, would wait for them anyway).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, PinnedHostSlice, sys};

use super::cuda_err;
use crate::arena::ArenaLayout;
use crate::batch::{TierDirection, TierMove};
use crate::error::{Error, Result};

/// The pinned host arrays of every pool (empty: no tier).
#[derive(Debug, Default)]
pub(super) struct HostTier {
    /// Per pool, `ArenaLayout` order; `None` for a pool without host blocks.
    pools: Vec<Option<PinnedHostSlice<u8>>>,
}

/// The bytes of block `block` of pool `pool` in an array of `elem_bytes`
/// elements laid out as `layout` says, when the array (`len` bytes) holds
/// them.
fn block_span(
    layout: &ArenaLayout,
    elem_bytes: usize,
    pool: usize,
    block: u32,
    len: usize,
) -> Option<std::ops::Range<usize>> {
    let per_block = layout.pools.get(pool)?.elems_per_block() * elem_bytes;
    let at = (block as usize).checked_mul(per_block)?;
    (per_block > 0 && at + per_block <= len).then_some(at..at + per_block)
}

/// Moves of one direction between consecutive blocks of one pool, copied as
/// one DMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    pool: usize,
    direction: TierDirection,
    device: u32,
    host: u32,
    blocks: u32,
}

impl HostTier {
    /// Allocates `host_blocks[i]` pinned blocks for pool `i` of `layout`,
    /// after checking that the host has that much memory available (pinned
    /// pages cannot be swapped out: asking the driver for more than the
    /// host has would push everything else out of memory first).
    pub(super) fn alloc(
        ctx: &Arc<CudaContext>,
        layout: &ArenaLayout,
        elem_bytes: usize,
        host_blocks: &[u32],
    ) -> Result<Self> {
        let sizes: Vec<usize> = layout
            .pools
            .iter()
            .zip(host_blocks.iter().copied().chain(std::iter::repeat(0)))
            .map(|(geometry, n)| n as usize * geometry.elems_per_block() * elem_bytes)
            .collect();
        let bytes: u64 = sizes.iter().map(|&n| n as u64).sum();
        if bytes == 0 {
            return Ok(HostTier::default());
        }
        check_host_memory(bytes, host_blocks, available_host_bytes())?;
        let pools = sizes
            .into_iter()
            .zip(&layout.pools)
            .map(|(size, geometry)| {
                if size == 0 {
                    return Ok(None);
                }
                // SAFETY: `alloc_pinned_with_flags` leaves the memory
                // uninitialised. The host never reads or writes it: only
                // the DMAs of `copy` do, and the worker's slot ledger
                // (which starts empty for the tier) keeps K/V that no
                // demotion wrote from being attended after an onboarding.
                // Flags 0: plain page-locked memory, cacheable for the CPU
                // (write-combined memory, cudarc's default, is only good
                // for host writes).
                let mem = unsafe { ctx.alloc_pinned_with_flags::<u8>(size, 0) }.map_err(|e| {
                    Error::Backend(format!(
                        "cannot pin the host tier of window {} ({} MiB): {e}",
                        geometry.window,
                        size >> 20
                    ))
                })?;
                Ok(Some(mem))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HostTier { pools })
    }

    /// Bytes of pinned host memory held.
    pub(super) fn bytes(&self) -> u64 {
        self.pools
            .iter()
            .flatten()
            .map(|p| p.num_bytes() as u64)
            .sum()
    }

    /// Runs `moves` (validated against the arena and the tier, demotions
    /// first) on `stream`, then waits for them.
    pub(super) fn copy(
        &mut self,
        stream: &Arc<CudaStream>,
        arena: &mut [CudaSlice<u8>],
        layout: &ArenaLayout,
        elem_bytes: usize,
        moves: &[TierMove],
    ) -> Result<()> {
        // The raw copies below need the context current on this thread
        // (cudarc's own calls bind it themselves).
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("bind context"))?;
        for run in runs(moves) {
            let epb = layout.pools[run.pool].elems_per_block() * elem_bytes;
            let n = run.blocks as usize * epb;
            let (device_at, host_at) = (run.device as usize * epb, run.host as usize * epb);
            let (Some(Some(host)), Some(device)) =
                (self.pools.get_mut(run.pool), arena.get_mut(run.pool))
            else {
                return Err(Error::Backend(format!(
                    "tier copy: pool {} has no host tier",
                    run.pool
                )));
            };
            if device_at + n > device.len() || host_at + n > host.len() {
                return Err(Error::Backend(format!(
                    "tier copy of pool {}: {} blocks at device block {} / host block {} are out \
                     of range",
                    run.pool, run.blocks, run.device, run.host
                )));
            }
            let to_host = match run.direction {
                TierDirection::Demote => true,
                TierDirection::Onboard => false,
                // validation keeps disk copies out of the backend's moves
                TierDirection::Spill | TierDirection::Load => {
                    return Err(Error::Backend(
                        "a disk-tier copy is not a device <-> host move".into(),
                    ));
                }
            };
            let bytes = n;
            // `as_mut_ptr` first waits for the allocation's event, which
            // cudarc records only for its own copies (this tier makes none),
            // so it returns at once.
            let host_base = host.as_mut_ptr().map_err(cuda_err("pinned host tier"))?;
            let (device_base, _in_use) = device.device_ptr_mut(stream);
            let device_ptr = device_base + device_at as u64;
            // SAFETY: `host_at + n <= host.len()` (checked above), so the
            // pointer and the `bytes` after it lie inside the pinned
            // allocation, which outlives the copy (`copy` waits for it
            // below, and the tier is only dropped with the backend).
            let host_ptr = unsafe { host_base.add(host_at) };
            // SAFETY: both ranges hold `bytes` bytes inside their
            // allocations (checked above); the device array belongs to
            // `stream`'s context; no Rust reference to the host range
            // exists while the DMA runs (the host never touches the
            // tier), and the wait below ends it before `copy` returns.
            let result = unsafe {
                if to_host {
                    sys::cuMemcpyDtoHAsync_v2(
                        host_ptr.cast(),
                        device_ptr,
                        bytes,
                        stream.cu_stream(),
                    )
                } else {
                    sys::cuMemcpyHtoDAsync_v2(
                        device_ptr,
                        host_ptr.cast_const().cast(),
                        bytes,
                        stream.cu_stream(),
                    )
                }
            };
            result.result().map_err(cuda_err("tier copy"))?;
        }
        stream.synchronize().map_err(cuda_err("tier copy wait"))
    }
}

impl HostTier {
    /// The bytes of host block `host_block` of pool `pool` (its K/V in the
    /// arena's block layout and element type, little-endian), for a spill to
    /// the disk tier. Every DMA into the tier was waited for by the
    /// [`HostTier::copy`] that made it, so the host reads what the last
    /// demotion wrote.
    pub(super) fn block_bytes(
        &self,
        layout: &ArenaLayout,
        elem_bytes: usize,
        pool: usize,
        host_block: u32,
    ) -> Result<Vec<u8>> {
        let host = self
            .pools
            .get(pool)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Backend(format!("pool {pool} has no host tier")))?;
        let bytes = host.as_slice().map_err(cuda_err("pinned host tier"))?;
        block_span(layout, elem_bytes, pool, host_block, bytes.len())
            .map(|span| bytes[span].to_vec())
            .ok_or_else(|| {
                Error::Backend(format!(
                    "host block {host_block} of pool {pool} is out of range"
                ))
            })
    }
}

/// The bytes of device block `block` of `arena` (as [`HostTier::block_bytes`]
/// gives a host block's), for a peer pull: the copy is ordered after every
/// pass queued on `stream`, and a copy into pageable memory returns only
/// once it has landed.
pub(super) fn device_block_bytes(
    stream: &Arc<CudaStream>,
    arena: &[CudaSlice<u8>],
    layout: &ArenaLayout,
    elem_bytes: usize,
    pool: usize,
    block: u32,
) -> Result<Vec<u8>> {
    let (device, span) = arena
        .get(pool)
        .and_then(|d| Some((d, block_span(layout, elem_bytes, pool, block, d.len())?)))
        .ok_or_else(|| {
            Error::Backend(format!(
                "device block {block} of pool {pool} is out of range"
            ))
        })?;
    stream
        .clone_dtoh(&device.slice(span))
        .map_err(cuda_err("peer pull read"))
}

/// Copies `bytes` (a block from [`HostTier::block_bytes`]) into device
/// block `device_block` of `arena` on `stream`, ahead of the passes queued
/// after it: a load from the disk tier.
pub(super) fn write_device_block(
    stream: &Arc<CudaStream>,
    arena: &mut [CudaSlice<u8>],
    layout: &ArenaLayout,
    elem_bytes: usize,
    pool: usize,
    device_block: u32,
    bytes: &[u8],
) -> Result<()> {
    let (device, span) = arena
        .get_mut(pool)
        .and_then(|d| {
            let span = block_span(layout, elem_bytes, pool, device_block, d.len())?;
            Some((d, span))
        })
        .filter(|(_, span)| span.len() == bytes.len())
        .ok_or_else(|| {
            Error::Backend(format!(
                "device block {device_block} of pool {pool}: out of range, or {} bytes for a block",
                bytes.len()
            ))
        })?;
    // From pageable memory the driver stages the source before the call
    // returns, so `bytes` may go; the copy is ordered before later passes.
    stream
        .memcpy_htod(bytes, &mut device.slice_mut(span))
        .map_err(cuda_err("disk tier load"))
}

/// Bytes of memory the host has available now (`MemAvailable` of
/// `/proc/meminfo`), if it says.
fn available_host_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a tier of `bytes` when the host has less available (`None`:
/// unknown, so the driver decides, up to what an allocation can address).
fn check_host_memory(bytes: u64, host_blocks: &[u32], available: Option<u64>) -> Result<()> {
    match available.or(Some(isize::MAX as u64)) {
        Some(available) if bytes > available => Err(Error::Config(format!(
            "--host-blocks {host_blocks:?} needs {} MiB of pinned host memory, the host has {} MiB available",
            bytes >> 20,
            available >> 20
        ))),
        _ => Ok(()),
    }
}

/// `moves` in order, consecutive moves of one pool and direction whose
/// device and host blocks both go up by one merged into one run.
fn runs(moves: &[TierMove]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for m in moves {
        if let Some(last) = runs.last_mut()
            && last.pool == m.pool
            && last.direction == m.direction
            && last.device.checked_add(last.blocks) == Some(m.device)
            && last.host.checked_add(last.blocks) == Some(m.host)
        {
            last.blocks += 1;
            continue;
        }
        runs.push(Run {
            pool: m.pool,
            direction: m.direction,
            device: m.device,
            host: m.host,
            blocks: 1,
        });
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mv(pool: usize, direction: TierDirection, device: u32, host: u32) -> TierMove {
        TierMove {
            pool,
            direction,
            device,
            host,
        }
    }

    #[test]
    fn a_tier_larger_than_the_available_host_memory_is_refused_with_the_figures() {
        let message = match check_host_memory(3 << 30, &[1000], Some(2 << 30)) {
            Err(Error::Config(message)) => message,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(
            message.contains("needs 3072 MiB") && message.contains("2048 MiB available"),
            "{message}"
        );
        assert!(check_host_memory(2 << 30, &[1000], Some(2 << 30)).is_ok());
        assert!(check_host_memory(3 << 30, &[1000], None).is_ok());
        assert!(check_host_memory(u64::MAX, &[u32::MAX], None).is_err());
        assert!(available_host_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn consecutive_blocks_of_one_pool_and_direction_are_one_run() {
        use TierDirection::{Demote, Onboard};
        let moves = [
            mv(0, Demote, 4, 10),
            mv(0, Demote, 5, 11),
            mv(0, Demote, 6, 12),
            mv(0, Demote, 8, 13), // device gap
            mv(1, Demote, 9, 14), // other pool
            mv(1, Onboard, 10, 15),
            mv(1, Onboard, 11, 17), // host gap
            mv(1, Onboard, 12, 18),
        ];
        let got: Vec<(usize, u32, u32, u32)> = runs(&moves)
            .iter()
            .map(|r| (r.pool, r.device, r.host, r.blocks))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 4, 10, 3),
                (0, 8, 13, 1),
                (1, 9, 14, 1),
                (1, 10, 15, 1),
                (1, 11, 17, 2)
            ]
        );
        assert_eq!(runs(&moves)[3].direction, Onboard);
        assert!(runs(&[]).is_empty());
    }
}
