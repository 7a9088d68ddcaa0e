//! A pass's [`RowPick`]s in device memory: the logit adjustments
//! (`adjust_logits`) and the sampled rows' parameters (`sample_rows`), so
//! the tokens are picked where the logits are; and its [`LogprobRow`]s
//! (`logprob_rows`), so only their values come back.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use super::cuda_err;
use crate::error::{Error, Result};
use crate::logprobs::{LogprobRow, MAX_TOP, RowLogprobs};
use crate::sampling::RowPick;

/// `adjust_logits`'s entries: logit (`rows[i]`, `tokens[i]`) changes as
/// [`crate::sampling::Adjust`] says. Each (row, token) once, rows below the
/// pass's logits rows and tokens below the vocabulary (checked on upload).
#[derive(Debug)]
pub(super) struct DeviceAdjusts {
    pub(super) n: usize,
    pub(super) rows: CudaSlice<u32>,
    pub(super) tokens: CudaSlice<u32>,
    pub(super) bias: CudaSlice<f32>,
    pub(super) repetition: CudaSlice<f32>,
    pub(super) penalty: CudaSlice<f32>,
}

/// `sample_rows`'s picks (temperature > 0): one entry per sampled row,
/// each row below the pass's logits rows and named once (checked on
/// upload).
#[derive(Debug)]
pub(super) struct DeviceSamples {
    pub(super) n: usize,
    pub(super) rows: CudaSlice<u32>,
    pub(super) temperature: CudaSlice<f32>,
    pub(super) top_k: CudaSlice<u32>,
    pub(super) top_p: CudaSlice<f32>,
    pub(super) min_p: CudaSlice<f32>,
    pub(super) draw: CudaSlice<f64>,
}

/// `mask_logits`'s masks: one per constrained row, `vocab.div_ceil(32)`
/// words each, rows named once and below the pass's logits rows (checked
/// on upload).
#[derive(Debug)]
pub(super) struct DeviceMasks {
    pub(super) n: usize,
    pub(super) rows: CudaSlice<u32>,
    pub(super) words: CudaSlice<u32>,
}

/// All three, for one pass; `None` where there is nothing to do.
#[derive(Debug)]
pub(super) struct DevicePicks {
    pub(super) adjusts: Option<DeviceAdjusts>,
    pub(super) masks: Option<DeviceMasks>,
    pub(super) samples: Option<DeviceSamples>,
}

fn up<T: DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    stream.clone_htod(v).map_err(cuda_err("upload picks"))
}

impl DevicePicks {
    /// Uploads `picks` for a pass of `rows` logits rows of width `vocab`.
    /// A pick naming a row twice, a row past `rows` or a token past `vocab`
    /// is refused (the worker never builds one; the kernels index with them).
    pub(super) fn upload(
        stream: &Arc<CudaStream>,
        picks: &[RowPick],
        rows: usize,
        vocab: usize,
    ) -> Result<Self> {
        let mut seen = vec![false; rows];
        for p in picks {
            match seen.get_mut(p.row) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(Error::Backend(format!(
                        "pick of row {} (the pass has {rows} logits rows, each picked once)",
                        p.row
                    )));
                }
            }
            let mut last = None;
            for a in &p.adjusts {
                if a.token as usize >= vocab || last.is_some_and(|l| l >= a.token) {
                    return Err(Error::Backend(format!(
                        "adjustment of token {} (vocabulary {vocab}, ascending, each once)",
                        a.token
                    )));
                }
                last = Some(a.token);
            }
            if let Some(m) = &p.mask
                && m.len() != vocab.div_ceil(32)
            {
                return Err(Error::Backend(format!(
                    "mask of row {} holds {} words; the vocabulary of {vocab} needs {}",
                    p.row,
                    m.len(),
                    vocab.div_ceil(32)
                )));
            }
        }
        let entries: Vec<(u32, &crate::sampling::Adjust)> = picks
            .iter()
            .flat_map(|p| p.adjusts.iter().map(move |a| (p.row as u32, a)))
            .collect();
        let adjusts = if entries.is_empty() {
            None
        } else {
            Some(DeviceAdjusts {
                n: entries.len(),
                rows: up(stream, &entries.iter().map(|e| e.0).collect::<Vec<_>>())?,
                tokens: up(
                    stream,
                    &entries.iter().map(|e| e.1.token).collect::<Vec<_>>(),
                )?,
                bias: up(
                    stream,
                    &entries.iter().map(|e| e.1.bias).collect::<Vec<_>>(),
                )?,
                repetition: up(
                    stream,
                    &entries.iter().map(|e| e.1.repetition).collect::<Vec<_>>(),
                )?,
                penalty: up(
                    stream,
                    &entries.iter().map(|e| e.1.penalty).collect::<Vec<_>>(),
                )?,
            })
        };
        let masked: Vec<(u32, &[u32])> = picks
            .iter()
            .filter_map(|p| p.mask.as_deref().map(|m| (p.row as u32, m)))
            .collect();
        let masks = if masked.is_empty() {
            None
        } else {
            Some(DeviceMasks {
                n: masked.len(),
                rows: up(stream, &masked.iter().map(|m| m.0).collect::<Vec<_>>())?,
                words: up(
                    stream,
                    &masked
                        .iter()
                        .flat_map(|m| m.1.iter().copied())
                        .collect::<Vec<_>>(),
                )?,
            })
        };
        let sampled: Vec<&RowPick> = picks.iter().filter(|p| p.temperature > 0.0).collect();
        let samples = if sampled.is_empty() {
            None
        } else {
            let col =
                |f: &dyn Fn(&RowPick) -> f32| sampled.iter().map(|p| f(p)).collect::<Vec<_>>();
            Some(DeviceSamples {
                n: sampled.len(),
                rows: up(
                    stream,
                    &sampled.iter().map(|p| p.row as u32).collect::<Vec<_>>(),
                )?,
                temperature: up(stream, &col(&|p| p.temperature))?,
                top_k: up(stream, &sampled.iter().map(|p| p.top_k).collect::<Vec<_>>())?,
                top_p: up(stream, &col(&|p| p.top_p))?,
                min_p: up(stream, &col(&|p| p.min_p))?,
                draw: up(stream, &sampled.iter().map(|p| p.draw).collect::<Vec<_>>())?,
            })
        };
        Ok(DevicePicks {
            adjusts,
            masks,
            samples,
        })
    }
}

/// `logprob_rows`'s entries: one per [`LogprobRow`] of a pass, each row
/// below the pass's logits rows and each chosen token below the vocabulary
/// (checked on upload), with the buffer the kernel writes (`stride` words
/// per entry, read back by [`DeviceLogprobs::read`]).
#[derive(Debug)]
pub(super) struct DeviceLogprobs {
    pub(super) n: usize,
    /// The most alternatives an entry asks for: the stride's `kmax`.
    pub(super) kmax: usize,
    pub(super) rows: CudaSlice<u32>,
    /// The chosen token, or [`PICKED`].
    pub(super) chosen: CudaSlice<u32>,
    pub(super) top: CudaSlice<u32>,
    pub(super) out: CudaSlice<u32>,
    asked: Vec<usize>,
}

/// `chosen` of an entry whose token is the one picked at its row.
const PICKED: u32 = u32::MAX;

impl DeviceLogprobs {
    /// Uploads `rows` for a pass of `logit_rows` rows of width `vocab`;
    /// `None` when there are none. A row past the pass, more than
    /// [`MAX_TOP`] alternatives or a chosen token past `vocab` is refused
    /// (the worker never builds one; the kernel indexes with them).
    pub(super) fn upload(
        stream: &Arc<CudaStream>,
        rows: &[LogprobRow],
        logit_rows: usize,
        vocab: usize,
    ) -> Result<Option<Self>> {
        if rows.is_empty() {
            return Ok(None);
        }
        if let Some(r) = rows.iter().find(|r| {
            r.row >= logit_rows || r.top > MAX_TOP || r.chosen.is_some_and(|c| c as usize >= vocab)
        }) {
            return Err(Error::Backend(format!(
                "logprobs of row {} (the pass has {logit_rows} logits rows), {} alternatives \
                 (at most {MAX_TOP}), chosen {:?} (vocabulary {vocab})",
                r.row, r.top, r.chosen
            )));
        }
        let kmax = rows.iter().map(|r| r.top).max().unwrap_or(0);
        let stride = 2 + 2 * kmax;
        Ok(Some(DeviceLogprobs {
            n: rows.len(),
            kmax,
            rows: up(
                stream,
                &rows.iter().map(|r| r.row as u32).collect::<Vec<_>>(),
            )?,
            chosen: up(
                stream,
                &rows
                    .iter()
                    .map(|r| r.chosen.unwrap_or(PICKED))
                    .collect::<Vec<_>>(),
            )?,
            top: up(
                stream,
                &rows.iter().map(|r| r.top as u32).collect::<Vec<_>>(),
            )?,
            out: stream
                .alloc_zeros(rows.len() * stride)
                .map_err(cuda_err("allocate logprobs"))?,
            asked: rows.iter().map(|r| r.top).collect(),
        }))
    }

    /// Words per entry of `out`.
    pub(super) fn stride(&self) -> usize {
        2 + 2 * self.kmax
    }

    /// The entries from `out` once the kernel wrote it (the stream waits).
    pub(super) fn read(&self, stream: &Arc<CudaStream>) -> Result<Vec<RowLogprobs>> {
        let out = stream
            .clone_dtoh(&self.out)
            .map_err(cuda_err("download logprobs"))?;
        let stride = self.stride();
        Ok(out
            .chunks_exact(stride)
            .zip(&self.asked)
            .map(|(e, &asked)| RowLogprobs {
                token: e[0],
                logprob: f32::from_bits(e[1]),
                top: (0..asked)
                    .filter(|&j| e[2 + j] != u32::MAX)
                    .map(|j| (e[2 + j], f32::from_bits(e[2 + self.kmax + j])))
                    .collect(),
            })
            .collect())
    }
}
