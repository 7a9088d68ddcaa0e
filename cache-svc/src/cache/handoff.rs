//! Disaggregated serving: a sequence whose prompt was prefilled in one
//! group (its prefill group) handed off to another (a decode group) with
//! `SeqSpec::handoff_of`.
//!
//! The hand-off is a peer pull that is forced, not weighed: the new lease
//! takes fresh blocks for the whole prompt (the source's tokens plus the
//! first token it sampled), and every block of the source's that holds a
//! token before the last becomes a peer copy, the last partly filled one
//! by its leading slots. The sources are pinned and fenced at the lease's
//! step as any peer pull's (`lease.rs`), so the holder may release the
//! source sequence at once, fenced at that step. Only peer groups (same
//! owner, peer key, block size and windows, see `peers.rs`) hand off.

use super::Cache;
use super::peers::PeerRun;
use crate::error::{Error, Result};
use crate::ids::{BlockId, SessionId};
use crate::lease::{Prompt, SeqSpec};
use crate::peer::{self, PeerDecision};
use crate::prefix;
use crate::session::SeqState;

/// What a hand-off lease pulls from its source.
#[derive(Clone, Debug)]
pub(super) struct Handoff {
    /// The source group, and per pool of the leasing group its pool and
    /// full blocks from `first[j]` to the last full block.
    pub(super) run: PeerRun,
    /// Per pool of the leasing group: the first block index it holds (the
    /// oldest block the first computed token's window reaches).
    pub(super) first: Vec<u32>,
    /// Per pool: the source's partly filled last block, when the prompt
    /// before its last token does not end on a block boundary.
    pub(super) last: Vec<Option<BlockId>>,
    /// Slots of those last blocks to copy (0: none).
    pub(super) last_tokens: u32,
    /// The forced decision, with the cost model's figures when the spec
    /// gave rates.
    pub(super) decision: PeerDecision,
}

impl Cache {
    /// Checks a hand-off's request against its source, where the source is
    /// held (an unknown source is a per-sequence reject): not itself, not a
    /// fork, one beam, a source in a peer group of another name, of one
    /// beam, whose tokens are the prompt's but the last.
    pub(super) fn validate_handoff(&self, session_id: SessionId, spec: &SeqSpec) -> Result<()> {
        let Some(src_id) = spec.handoff_of else {
            return Ok(());
        };
        let seq_id = spec.seq_id;
        let invalid = |why: String| {
            Err(Error::InvalidArgument(format!(
                "sequence {seq_id}: handoff_of {src_id}: {why}"
            )))
        };
        if src_id == seq_id {
            return invalid("a sequence cannot hand itself off".into());
        }
        if spec.fork_of.is_some() {
            return invalid("a sequence is a fork or a hand-off, not both (fork_of is set)".into());
        }
        if spec.beam_width > 1 {
            return invalid(format!(
                "a hand-off is one beam, beam_width must be 1, got {}",
                spec.beam_width
            ));
        }
        let Some(src) = self
            .sessions
            .get(&session_id)
            .and_then(|s| s.seqs.get(&src_id))
        else {
            return Ok(());
        };
        let Some(group) = self.groups.get(&spec.group) else {
            return Ok(());
        };
        let src_group = self.group_of(src);
        if src_group == spec.group {
            return invalid(format!(
                "it is held in {src_group}, the lease's own group: hand off to another"
            ));
        }
        if !self
            .peers_of(&spec.group, group)
            .iter()
            .any(|(name, _)| *name == src_group)
        {
            return invalid(format!(
                "it is held in {src_group}, which is not a peer of {} (same owner, peer_key, tokens per block, windows and bytes per block)",
                spec.group
            ));
        }
        if src.beams != 1 {
            return invalid(format!(
                "it holds {} beams, a hand-off takes one",
                src.beams
            ));
        }
        if spec.prompt.len() != src.len + 1 {
            return invalid(format!(
                "the prompt must be its {} tokens and the one it sampled, got {} tokens",
                src.len,
                spec.prompt.len()
            ));
        }
        if let (Prompt::Tokens(tokens), true) = (&spec.prompt, src.hashable) {
            if prefix::salt_hash(&spec.cache_salt) != src.salt {
                return invalid("its cache_salt is not the source's".into());
            }
            if !holds_tokens(src, &tokens[..src.len as usize], group.tokens_per_block) {
                return invalid("its prompt is not the tokens the source holds".into());
            }
        }
        Ok(())
    }

    /// The group whose pools hold `seq`'s tables.
    fn group_of(&self, seq: &SeqState) -> String {
        seq.tables
            .first()
            .map(|t| self.pools[t.pool].group.clone())
            .unwrap_or_default()
    }

    /// What a hand-off lease pulls from its source (checked by
    /// [`Cache::validate_handoff`]), or `None` when the source cannot give
    /// it (not held, not written through the prompt's last token but one,
    /// its table slid past the blocks): the sequence is then leased as any.
    pub(super) fn handoff_source(&self, session_id: SessionId, spec: &SeqSpec) -> Option<Handoff> {
        let src = self
            .sessions
            .get(&session_id)?
            .seqs
            .get(&spec.handoff_of?)?;
        let group = self.groups.get(&spec.group)?;
        let src_group = self.group_of(src);
        let (_, src_pools) = self
            .peers_of(&spec.group, group)
            .into_iter()
            .find(|(name, _)| *name == src_group)?;
        let b = group.tokens_per_block;
        // the decode group computes the last prompt token (the one the
        // prefill sampled): every position before it is pulled
        let k = spec.prompt.len().checked_sub(1)?;
        if src.written.min(src.len) < k || src.beams != 1 {
            return None;
        }
        let (full, last_tokens) = (k / b, k % b);
        let end = full + u32::from(last_tokens > 0);
        let (mut pools, mut first, mut last) = (Vec::new(), Vec::new(), Vec::new());
        let mut bytes = 0u64;
        let mut blocks = 0u32;
        for (&i, &j) in group.pools.iter().zip(&src_pools) {
            let window = self.pools[i].window;
            let from = match window {
                0 => 0,
                w => (k + 1).saturating_sub(w) / b,
            };
            let bt = src.tables.iter().find(|t| t.pool == j)?.beams.first()?;
            if from < end && (from < bt.first || end > bt.end()) {
                return None;
            }
            let at = |idx: u32| bt.blocks.get((idx - bt.first) as usize).copied();
            let run = (from..full).map(at).collect::<Option<Vec<BlockId>>>()?;
            let tail = match last_tokens {
                0 => None,
                _ => Some(at(full)?),
            };
            let moved = run.len() as u32 + u32::from(tail.is_some());
            blocks = blocks.max(moved);
            bytes =
                bytes.saturating_add(u64::from(moved).saturating_mul(group.peer.bytes_of(window)));
            pools.push((j, run));
            first.push(from);
            last.push(tail);
        }
        let mut decision = match &spec.peer_pull {
            Some(rates) => peer::decide(rates, &src_group, blocks, bytes, b),
            None => PeerDecision {
                src_group: src_group.clone(),
                blocks,
                bytes,
                pull_us: 0,
                recompute_us: 0,
                pulled: true,
                forced: true,
            },
        };
        decision.pulled = true;
        decision.forced = true;
        Some(Handoff {
            run: PeerRun {
                group: src_group,
                end: full,
                pools,
                bytes,
            },
            first,
            last,
            last_tokens,
            decision,
        })
    }
}

/// Whether `seq` (hashable) holds exactly `tokens` (its length): its full
/// blocks' hashes and the tokens of its partly filled one.
pub(super) fn holds_tokens(seq: &SeqState, tokens: &[u32], tokens_per_block: u32) -> bool {
    let b = tokens_per_block as usize;
    let hashes = prefix::chain(seq.salt, tokens, b);
    let known = hashes.len().min(seq.hashes.len());
    let mut same = hashes[..known] == seq.hashes[..known];
    if known == seq.hashes.len() {
        let rest = &tokens[known * b..];
        same &= seq.partial.get(..rest.len()) == Some(rest);
    }
    same
}
