//! A pass's [`RowPick`]s in device memory: the logit adjustments
//! (`adjust_logits`) and the sampled rows' parameters (`sample_rows`), so
//! the tokens are picked where the logits are.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use super::cuda_err;
use crate::error::{Error, Result};
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
