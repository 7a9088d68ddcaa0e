//! Traces in the public Mooncake format: JSON lines of
//! `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [..]}`
//! where each hash id names one 512-token block of the prompt, and equal
//! ids mean equal content (a shared prefix).
//!
//! [`expand`] turns a record into token ids: every hash id becomes the same
//! run of tokens wherever it appears ([`block_tokens`]), so the trace's
//! prefix sharing becomes real prefix reuse in the cache. Lengths are
//! divided by a scale factor so the small CPU model can serve them.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::workload::{Request, block_tokens};

/// Tokens per hash id in the Mooncake format.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Record {
    /// Arrival time in milliseconds.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    /// Leading prompt tokens the request asks the cache to retain (an
    /// extension of the format, written by `kvlease cache-trace --kind
    /// agent`; absent = no hint).
    #[serde(default)]
    pub retain_tokens: Option<u32>,
}

/// Parses a whole trace; blank lines are skipped. The error names the
/// first bad line (1-based).
pub fn parse(text: &str) -> std::result::Result<Vec<Record>, (usize, String)> {
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(line).map_err(|e| (i + 1, e.to_string()))?;
        if record.hash_ids.is_empty() && record.input_length > 0 {
            return Err((i + 1, "hash_ids is empty but input_length is not".into()));
        }
        records.push(record);
    }
    Ok(records)
}

/// Reads and parses a trace file.
pub fn read(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::TraceIo {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|(line, message)| Error::TraceParse {
        path: path.to_path_buf(),
        line,
        message,
    })
}

/// How records become requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Expand {
    /// Lengths (and each hash block) are divided by this; 1 keeps them.
    pub scale: u32,
    /// Prompts are cut to this many tokens (keeping their prefix); 0 = no cut.
    pub max_prompt: u32,
    /// Outputs are capped at this many tokens; 0 = no cap.
    pub max_output: u32,
    /// Arrival times are divided by this (2.0 replays twice as fast).
    pub speedup: f64,
}

impl Default for Expand {
    fn default() -> Self {
        Self {
            scale: 32,
            max_prompt: 0,
            max_output: 0,
            speedup: 1.0,
        }
    }
}

impl Expand {
    /// Tokens one hash id expands to.
    pub fn block_len(&self) -> u32 {
        (MOONCAKE_BLOCK_TOKENS / self.scale.max(1)).max(1)
    }
}

/// The requests of `records`, arrivals relative to the first record.
pub fn expand(records: &[Record], how: Expand) -> Vec<Request> {
    let start = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let scale = how.scale.max(1);
    let block_len = how.block_len();
    records
        .iter()
        .enumerate()
        .map(|(index, r)| {
            let mut len = r.input_length.div_ceil(scale).max(1);
            if how.max_prompt > 0 {
                len = len.min(how.max_prompt);
            }
            let mut tokens: Vec<u32> = r
                .hash_ids
                .iter()
                .flat_map(|&h| block_tokens(h, block_len))
                .take(len as usize)
                .collect();
            // a record whose hash ids cover less than its length: the rest is
            // unique to it
            let missing = len.saturating_sub(tokens.len() as u32);
            tokens.extend(block_tokens((1 << 62) | index as u64, missing));
            let mut max_tokens = r.output_length.div_ceil(scale).max(1);
            if how.max_output > 0 {
                max_tokens = max_tokens.min(how.max_output);
            }
            let offset_ms = (r.timestamp - start) as f64 / how.speedup.max(1e-6);
            Request {
                index,
                at: Some(Duration::from_secs_f64(offset_ms / 1000.0)),
                tokens,
                max_tokens,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("../data/sample-mooncake.jsonl");

    #[test]
    fn sample_trace_parses() {
        let records = parse(SAMPLE).map_err(|e| format!("{e:?}"));
        assert!(records.is_ok(), "{records:?}");
        let records = records.unwrap_or_default();
        assert_eq!(records.len(), 50);
        for r in &records {
            // Mooncake: one hash id per started 512-token block
            assert_eq!(
                r.hash_ids.len() as u32,
                r.input_length.div_ceil(MOONCAKE_BLOCK_TOKENS),
                "{r:?}"
            );
        }
        assert!(records.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    }

    #[test]
    fn parse_reports_the_bad_line() {
        let text = "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n\n{\"timestamp\":1}\n";
        let err = parse(text).err();
        assert_eq!(err.map(|(line, _)| line), Some(3));
        let empty = "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[]}";
        assert!(parse(empty).is_err());
    }

    #[test]
    fn equal_hash_ids_give_equal_prefixes() {
        let records = vec![
            Record {
                timestamp: 1000,
                input_length: 1200,
                output_length: 64,
                hash_ids: vec![5, 6, 7],
                retain_tokens: None,
            },
            Record {
                timestamp: 1500,
                input_length: 1100,
                output_length: 10,
                hash_ids: vec![5, 6, 9],
                retain_tokens: None,
            },
            Record {
                timestamp: 3000,
                input_length: 300,
                output_length: 1,
                hash_ids: vec![8],
                retain_tokens: None,
            },
        ];
        let how = Expand {
            scale: 32,
            speedup: 2.0,
            ..Expand::default()
        };
        let reqs = expand(&records, how);
        assert_eq!(how.block_len(), 16);
        // lengths scaled down, rounding up
        assert_eq!(reqs[0].tokens.len(), 38);
        assert_eq!(reqs[1].tokens.len(), 35);
        assert_eq!(reqs[2].tokens.len(), 10);
        assert_eq!(reqs[0].max_tokens, 2);
        assert_eq!(reqs[2].max_tokens, 1);
        // blocks 5 and 6 are shared, block 7 vs 9 differs
        assert_eq!(reqs[0].tokens[..32], reqs[1].tokens[..32]);
        assert_ne!(reqs[0].tokens[32..35], reqs[1].tokens[32..35]);
        assert_ne!(reqs[0].tokens[..10], reqs[2].tokens[..]);
        // arrivals relative to the first, replayed twice as fast
        assert_eq!(reqs[0].at, Some(Duration::ZERO));
        assert_eq!(reqs[1].at, Some(Duration::from_millis(250)));
        assert_eq!(reqs[2].at, Some(Duration::from_millis(1000)));
    }

    #[test]
    fn caps_keep_the_prefix() {
        let records = vec![Record {
            timestamp: 0,
            input_length: 4096,
            output_length: 900,
            hash_ids: (0..8).collect(),
            retain_tokens: None,
        }];
        let full = expand(
            &records,
            Expand {
                scale: 1,
                ..Expand::default()
            },
        );
        let cut = expand(
            &records,
            Expand {
                scale: 1,
                max_prompt: 100,
                max_output: 7,
                ..Expand::default()
            },
        );
        assert_eq!(full[0].tokens.len(), 4096);
        assert_eq!(cut[0].tokens, full[0].tokens[..100]);
        assert_eq!(cut[0].max_tokens, 7);
    }
}
