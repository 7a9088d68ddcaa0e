//! A generator of multi-turn conversation traces in the Mooncake format:
//! sessions arrive at random, each opens with one of a few system prompts
//! (Zipf-popular), and after each turn comes back with a probability, after
//! a think time, with a prompt that extends the previous one by the answer
//! and a new user message. Seeded and deterministic.

use crate::mooncake::{MOONCAKE_BLOCK_TOKENS, Record};
use crate::workload::SplitMix64;

/// The shape of a generated trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversations {
    /// Conversations in the trace.
    pub sessions: usize,
    /// Blocks every request starts with, before its system prompt (a
    /// prompt shared by every session; 0 for none).
    pub shared_root_blocks: u32,
    /// Distinct system prompts.
    pub system_prompts: u32,
    /// Zipf exponent of system prompt popularity (0 = uniform).
    pub zipf: f64,
    /// System prompt length range, in blocks.
    pub system_blocks: (u32, u32),
    /// User message length range, in blocks.
    pub user_blocks: (u32, u32),
    /// Answer length range, in blocks.
    pub answer_blocks: (u32, u32),
    /// Probability that a conversation comes back after a turn.
    pub return_probability: f64,
    /// Most turns of one conversation.
    pub max_turns: u32,
    /// Mean think time between turns, in milliseconds (exponential).
    pub think_ms: f64,
    /// Mean gap between new conversations, in milliseconds (exponential).
    pub arrival_gap_ms: f64,
    pub seed: u64,
}

impl Default for Conversations {
    fn default() -> Self {
        Self {
            sessions: 1500,
            shared_root_blocks: 0,
            system_prompts: 40,
            zipf: 1.0,
            system_blocks: (2, 12),
            user_blocks: (1, 8),
            answer_blocks: (1, 4),
            return_probability: 0.6,
            max_turns: 12,
            think_ms: 60_000.0,
            arrival_gap_ms: 400.0,
            seed: 1,
        }
    }
}

impl SplitMix64 {
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean`.
    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

impl Conversations {
    /// The trace, by arrival time; the same shape always gives the same trace.
    pub fn records(&self) -> Vec<Record> {
        let mut rng = SplitMix64(self.seed ^ 0x636f_6e76_6f73_2121);
        let prompts = self.system_prompts.max(1);
        let mut next_id = 0u64;
        let mut fresh = |n: u32| {
            let ids: Vec<u64> = (next_id..next_id + u64::from(n)).collect();
            next_id += u64::from(n);
            ids
        };
        let root = fresh(self.shared_root_blocks);
        let systems: Vec<Vec<u64>> = (0..prompts)
            .map(|_| {
                let len = rng.between(self.system_blocks.0, self.system_blocks.1);
                let mut system = root.clone();
                system.extend(fresh(len.max(1)));
                system
            })
            .collect();
        // Zipf over the prompts' ranks: weight 1 / (rank + 1)^s.
        let mut cdf: Vec<f64> = (0..prompts)
            .scan(0.0, |acc, r| {
                *acc += 1.0 / f64::from(r + 1).powf(self.zipf);
                Some(*acc)
            })
            .collect();
        let total = cdf.last().copied().unwrap_or(1.0);
        cdf.iter_mut().for_each(|c| *c /= total);

        let mut timed: Vec<(f64, usize, Record)> = Vec::new();
        let mut start = 0.0;
        for _ in 0..self.sessions {
            start += rng.exponential(self.arrival_gap_ms);
            let u = rng.unit();
            let system = cdf.partition_point(|&c| c < u).min(cdf.len() - 1);
            let mut chain = systems[system].clone();
            let mut at = start;
            for turn in 0..self.max_turns.max(1) {
                if turn > 0 {
                    if rng.unit() >= self.return_probability {
                        break;
                    }
                    let answer = rng.between(self.answer_blocks.0, self.answer_blocks.1);
                    chain.extend(fresh(answer));
                    at += rng.exponential(self.think_ms);
                }
                let user = rng.between(self.user_blocks.0, self.user_blocks.1);
                chain.extend(fresh(user.max(1)));
                let output_blocks = rng.between(self.answer_blocks.0, self.answer_blocks.1);
                let record = Record {
                    timestamp: at as u64,
                    input_length: chain.len() as u32 * MOONCAKE_BLOCK_TOKENS,
                    output_length: output_blocks * MOONCAKE_BLOCK_TOKENS,
                    hash_ids: chain.clone(),
                    retain_tokens: None,
                };
                timed.push((at, timed.len(), record));
            }
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        timed.into_iter().map(|(_, _, r)| r).collect()
    }
}

/// The shape of a generated agent-style trace: a few long tool prompts
/// (system prompt plus tool definitions, many blocks each), sessions that
/// open with one of them and add their own turns, each returning after a
/// long gap, and one-off flood requests (fresh blocks, no reuse) between
/// them, enough that an unhinted LRU evicts a returning session's prefix.
/// Each session request carries `retain_tokens`: its tool prompt's length.
#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    /// Agent sessions.
    pub sessions: usize,
    /// Distinct tool prompts (uniformly chosen).
    pub tool_prompts: u32,
    /// Tool prompt length, in blocks.
    pub tool_blocks: u32,
    /// Turns of each session.
    pub turns: u32,
    /// Blocks a turn adds (tool output and user message).
    pub turn_blocks: (u32, u32),
    /// Gap before a session returns, in milliseconds (exponential mean).
    pub return_gap_ms: f64,
    /// Mean gap between new sessions, in milliseconds (exponential).
    pub arrival_gap_ms: f64,
    /// Flood requests per new session (one-off, never reused).
    pub flood_per_session: u32,
    /// Flood request length range, in blocks.
    pub flood_blocks: (u32, u32),
    pub seed: u64,
}

impl Default for Agent {
    fn default() -> Self {
        Self {
            sessions: 400,
            tool_prompts: 4,
            tool_blocks: 48,
            turns: 4,
            turn_blocks: (1, 4),
            return_gap_ms: 60_000.0,
            arrival_gap_ms: 2_000.0,
            flood_per_session: 4,
            flood_blocks: (8, 32),
            seed: 1,
        }
    }
}

impl Agent {
    /// The trace, by arrival time; the same shape always gives the same trace.
    pub fn records(&self) -> Vec<Record> {
        let mut rng = SplitMix64(self.seed ^ 0x6167_656e_7421_2121);
        let mut next_id = 0u64;
        let mut fresh = |n: u32| {
            let ids: Vec<u64> = (next_id..next_id + u64::from(n)).collect();
            next_id += u64::from(n);
            ids
        };
        let tool_blocks = self.tool_blocks.max(1);
        let tools: Vec<Vec<u64>> = (0..self.tool_prompts.max(1))
            .map(|_| fresh(tool_blocks))
            .collect();
        let mut timed: Vec<(f64, usize, Record)> = Vec::new();
        let mut push = |at: f64, chain: &[u64], retain: Option<u32>| {
            let record = Record {
                timestamp: at as u64,
                input_length: chain.len() as u32 * MOONCAKE_BLOCK_TOKENS,
                output_length: MOONCAKE_BLOCK_TOKENS,
                hash_ids: chain.to_vec(),
                retain_tokens: retain,
            };
            timed.push((at, timed.len(), record));
        };
        let mut start = 0.0;
        for _ in 0..self.sessions {
            start += rng.exponential(self.arrival_gap_ms);
            let tool = rng.below(tools.len() as u64) as usize;
            let mut chain = tools[tool].clone();
            let retain = Some(tool_blocks * MOONCAKE_BLOCK_TOKENS);
            let mut at = start;
            for turn in 0..self.turns.max(1) {
                if turn > 0 {
                    at += rng.exponential(self.return_gap_ms);
                }
                let n = rng.between(self.turn_blocks.0, self.turn_blocks.1);
                chain.extend(fresh(n.max(1)));
                push(at, &chain, retain);
            }
            for _ in 0..self.flood_per_session {
                let n = rng.between(self.flood_blocks.0, self.flood_blocks.1);
                let at = start + rng.unit() * self.arrival_gap_ms;
                push(at, &fresh(n.max(1)), None);
            }
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        timed.into_iter().map(|(_, _, r)| r).collect()
    }
}

/// `records` as Mooncake JSON lines.
pub fn to_jsonl(records: &[Record]) -> String {
    let mut out = String::new();
    for r in records {
        let ids: Vec<String> = r.hash_ids.iter().map(u64::to_string).collect();
        let retain = r
            .retain_tokens
            .map(|t| format!(", \"retain_tokens\": {t}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]{}}}\n",
            r.timestamp,
            r.input_length,
            r.output_length,
            ids.join(", "),
            retain
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_traces_are_seeded_and_hinted() {
        let seeded = |seed| {
            Agent {
                sessions: 20,
                seed,
                ..Agent::default()
            }
            .records()
        };
        let records = seeded(1);
        assert_eq!(records, seeded(1));
        assert_ne!(records, seeded(2));
        let hinted: Vec<&Record> = records
            .iter()
            .filter(|r| r.retain_tokens.is_some())
            .collect();
        assert_eq!(hinted.len(), 20 * 4);
        assert_eq!(records.len(), 20 * 4 + 20 * 4);
        let tool = 48 * MOONCAKE_BLOCK_TOKENS;
        assert!(
            hinted
                .iter()
                .all(|r| r.retain_tokens == Some(tool) && r.input_length > tool)
        );
        let parsed = crate::mooncake::parse(&to_jsonl(&records)).unwrap();
        assert_eq!(parsed, records);
    }

    #[test]
    fn deterministic_and_round_trips_through_the_parser() {
        let shape = Conversations {
            sessions: 50,
            ..Conversations::default()
        };
        let a = shape.records();
        assert_eq!(a, shape.records());
        let other = Conversations {
            seed: 2,
            ..shape.clone()
        };
        assert_ne!(a, other.records());
        let parsed = crate::mooncake::parse(&to_jsonl(&a)).map_err(|e| format!("{e:?}"));
        assert_eq!(parsed.as_ref(), Ok(&a));
        assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    }

    #[test]
    fn a_shared_root_opens_every_request_and_is_off_by_default() {
        let plain = Conversations {
            sessions: 100,
            ..Conversations::default()
        };
        let rooted = Conversations {
            shared_root_blocks: 2,
            ..plain.clone()
        };
        let records = rooted.records();
        let root = &records[0].hash_ids[..2];
        assert!(records.iter().all(|r| &r.hash_ids[..2] == root));
        // without it, no block opens every request
        let plain = plain.records();
        assert!(plain.iter().any(|r| r.hash_ids[0] != plain[0].hash_ids[0]));
        assert_eq!(records.len(), plain.len());
    }

    #[test]
    fn turns_extend_their_conversation_and_prompts_are_zipf_popular() {
        let shape = Conversations {
            sessions: 400,
            system_prompts: 10,
            zipf: 1.2,
            return_probability: 0.7,
            ..Conversations::default()
        };
        let records = shape.records();
        assert!(records.len() > 400, "some conversations came back");
        // Every later turn extends an earlier request's whole prompt.
        let prompts: std::collections::HashSet<&[u64]> =
            records.iter().map(|r| r.hash_ids.as_slice()).collect();
        let extended = records
            .iter()
            .filter(|r| (1..r.hash_ids.len()).any(|n| prompts.contains(&r.hash_ids[..n])))
            .count();
        assert!(extended > 100, "{extended} follow-up turns");
        // The most popular system prompt (first block) opens more
        // conversations than the least popular.
        let mut opens = std::collections::HashMap::new();
        for r in &records {
            *opens.entry(r.hash_ids[0]).or_insert(0u32) += 1;
        }
        let most = opens.values().max().copied().unwrap_or(0);
        let least = opens.values().min().copied().unwrap_or(0);
        assert!(most > 4 * least.max(1), "most {most}, least {least}");
    }
}
