//! `Match`: what a `Lease` would reuse right now, for routing a new request
//! to the replica (pool group) that holds its prefix.
//!
//! Read-only by construction: it walks the prefix index with `&self` lookups
//! ([`crate::pool::BlockPool::lookup`]), which neither pin nor touch a
//! block, so the eviction order, the hit-rate counters and the miss-ratio
//! curves stay exactly as they were. The one thing it changes is the
//! caller's session TTL, as every call that names a session does.
//!
//! The reuse rule is the one `Lease` applies ([`Cache::reusable_blocks`] is
//! shared by both): the longest prefix of published full blocks that every
//! pool of the group serves, from its device blocks or, after them, from
//! its host tier (a lease onboards those), never the block of the last
//! prompt token.
//! Partial-block copies are not counted: they save less than a block and
//! are not worth a routing decision.

use std::time::Instant;

use super::{Cache, Group};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SessionId};
use crate::prefix;

/// One prompt to match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MatchPrompt {
    /// Its token ids (at least one).
    pub tokens: Vec<u32>,
    /// Its cache salt, as a lease of it would carry.
    pub cache_salt: String,
}

/// What a prompt would reuse in one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matched {
    /// Prompt tokens a lease reuses from the group's device and tiers.
    pub reused_tokens: u32,
    /// Prompt tokens after those a peer pull could bring.
    pub peer_tokens: u32,
}

/// The first block index a pool of `window` (0: full attention) holds of a
/// sequence that reuses `reused` blocks of `tokens_per_block`: the oldest
/// block the first computed token's window reaches.
pub(super) fn first_block(window: u32, reused: u32, tokens_per_block: u32) -> u32 {
    if window == 0 {
        0
    } else {
        (reused * tokens_per_block + 1).saturating_sub(window) / tokens_per_block
    }
}

impl Cache {
    /// For each prompt, the prompt tokens a `Lease` in each of `groups` (in
    /// order) would reuse now, in full blocks. Changes nothing but the
    /// session's TTL. Only groups registered by the session's principal may
    /// be named.
    pub fn match_prefixes(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        groups: &[String],
        prompts: &[MatchPrompt],
        now: Instant,
    ) -> Result<Vec<Vec<u32>>> {
        let rows = self.match_with_peers(session_id, epoch, groups, prompts, now)?;
        Ok(rows
            .into_iter()
            .map(|row| row.into_iter().map(|m| m.reused_tokens).collect())
            .collect())
    }

    /// [`match_prefixes`](Self::match_prefixes), with the tokens a peer
    /// pull could bring after the reused ones in each group (before the
    /// cost model decides; see `peers`).
    pub fn match_with_peers(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        groups: &[String],
        prompts: &[MatchPrompt],
        now: Instant,
    ) -> Result<Vec<Vec<Matched>>> {
        self.touch(session_id, epoch, now)?;
        if groups.is_empty() {
            return Err(Error::InvalidArgument(
                "pool_groups must name at least one group".into(),
            ));
        }
        if prompts.is_empty() {
            return Err(Error::InvalidArgument(
                "prompts must hold at least one prompt".into(),
            ));
        }
        if let Some(i) = prompts.iter().position(|p| p.tokens.is_empty()) {
            return Err(Error::InvalidArgument(format!(
                "prompts[{i}].prompt_tokens must not be empty"
            )));
        }
        let principal = self.session_principal(session_id)?;
        let mut resolved = Vec::with_capacity(groups.len());
        for name in groups {
            resolved.push((name, self.owned_group(name, &principal, "match")?));
        }
        let mut results = Vec::with_capacity(prompts.len());
        // one hash chain per prompt and block size, shared by the groups
        let mut chains: Vec<(u32, Vec<u64>)> = Vec::new();
        for p in prompts {
            chains.clear();
            let salt = prefix::salt_hash(&p.cache_salt);
            let len = u32::try_from(p.tokens.len()).unwrap_or(u32::MAX);
            let mut row = Vec::with_capacity(resolved.len());
            for &(name, group) in &resolved {
                let b = group.tokens_per_block;
                let at = match chains.iter().position(|(tb, _)| *tb == b) {
                    Some(at) => at,
                    None => {
                        chains.push((b, prefix::chain(salt, &p.tokens, b as usize)));
                        chains.len() - 1
                    }
                };
                let hashes = &chains[at].1;
                let reused = self.reusable_blocks(group, hashes, len).0;
                let most = (len.saturating_sub(1) / b).min(hashes.len() as u32);
                let peer = self
                    .peer_run(name, group, hashes, reused, most)
                    .map_or(0, |r| r.end - reused);
                row.push(Matched {
                    reused_tokens: reused * b,
                    peer_tokens: peer * b,
                });
            }
            results.push(row);
        }
        Ok(results)
    }

    /// Full blocks of a prompt of `prompt_len` tokens (whose full-block
    /// hashes are `hashes`) that a lease in `group` reuses, and where each
    /// pool's run of device blocks ends (in the group's pool order): at most
    /// the blocks before the last prompt token (at least one token is
    /// computed: its logits start the output). First the longest prefix
    /// every pool can serve from its device blocks: full-attention pools
    /// need every block before it, windowed pools only those the first
    /// computed token's window reaches. Then the blocks after it that every
    /// pool holds on its device (continuing its run of device blocks) or on
    /// its host or disk tier (once a block came from there, the rest of that
    /// pool's must too): a lease onboards those instead of recomputing them.
    pub(super) fn reusable_blocks(
        &self,
        group: &Group,
        hashes: &[u64],
        prompt_len: u32,
    ) -> (u32, Vec<u32>) {
        let b = group.tokens_per_block;
        let most = (prompt_len.saturating_sub(1) / b).min(hashes.len() as u32);
        let mut reuse = most;
        'shrink: while reuse > 0 {
            for &i in &group.pools {
                let entry = &self.pools[i];
                let first = first_block(entry.window, reuse, b);
                for idx in (first..reuse).rev() {
                    if entry.pool.lookup(hashes[idx as usize]).is_none() {
                        reuse = idx;
                        continue 'shrink;
                    }
                }
            }
            break;
        }
        let mut device_end: Vec<u32> = vec![reuse; group.pools.len()];
        let has_host = group.pools.iter().any(|&i| {
            let pool = &self.pools[i].pool;
            !pool.host().is_empty() || !pool.disk().is_empty()
        });
        if has_host {
            for (end, &i) in device_end.iter_mut().zip(&group.pools) {
                let pool = &self.pools[i].pool;
                while *end < most && pool.lookup(hashes[*end as usize]).is_some() {
                    *end += 1;
                }
            }
            'grow: while reuse < most {
                let idx = reuse;
                for (&end, &i) in device_end.iter().zip(&group.pools) {
                    let (pool, hash) = (&self.pools[i].pool, hashes[idx as usize]);
                    if idx >= end
                        && pool.host().lookup(hash).is_none()
                        && pool.disk().lookup(hash).is_none()
                    {
                        break 'grow;
                    }
                }
                reuse += 1;
            }
        }
        (reuse, device_end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::{Outcome, Prompt, SeqSpec};
    use crate::tests::{Fixture, GROUP};

    /// A fixture whose group has one full-attention pool of `blocks` blocks
    /// of 4 tokens.
    fn fixture(blocks: u32) -> Fixture {
        Fixture::new(4, &[(0, blocks)])
    }

    /// Leases `tokens` in `group` as sequence `seq` (salt `salt`) at step
    /// `seq`, completes the step (publishing its blocks) and releases it;
    /// returns the reused tokens of its grant.
    fn serve(f: &mut Fixture, group: &str, seq: u64, tokens: &[u32], salt: &str) -> u32 {
        let mut spec = SeqSpec::new(crate::SeqId(seq), group, Prompt::Tokens(tokens.to_vec()));
        spec.cache_salt = salt.into();
        let out = f.lease(seq, false, &[spec]);
        let Outcome::Grant(grant) = &out[0] else {
            panic!("lease refused: {out:?}");
        };
        f.complete(seq);
        f.release(&[seq], None);
        grant.reused_tokens
    }

    fn matched(
        f: &mut Fixture,
        groups: &[&str],
        prompts: &[(&[u32], &str)],
    ) -> Result<Vec<Vec<u32>>> {
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let prompts: Vec<MatchPrompt> = prompts
            .iter()
            .map(|&(t, s)| MatchPrompt {
                tokens: t.to_vec(),
                cache_salt: s.to_string(),
            })
            .collect();
        f.cache
            .match_prefixes(f.session, f.epoch, &groups, &prompts, f.now)
    }

    fn tokens(start: u32, n: u32) -> Vec<u32> {
        (start..start + n).collect()
    }

    #[test]
    fn match_reports_what_a_lease_then_reuses_per_group_and_salt() {
        let mut f = fixture(64);
        f.cache.register_pool("m/r1", 4, &[(0, 64)]).unwrap();
        let first = tokens(100, 10);
        serve(&mut f, GROUP, 1, &first, "");
        // the next turn: the first turn's 10 tokens (2 full blocks) and more
        let mut next = first.clone();
        next.extend(tokens(500, 7));
        let got = matched(
            &mut f,
            &[GROUP, "m/r1"],
            &[
                (&next[..], ""),
                (&next[..], "other-tenant"),
                (&first[..], ""),
                (&first[..8], ""),
            ],
        )
        .unwrap();
        // a prompt of exactly its cached blocks keeps its last block to compute
        assert_eq!(got, vec![vec![8, 0], vec![0, 0], vec![8, 0], vec![4, 0]]);
        // the lease reuses the matched full blocks, plus a copy of the 2
        // slots the first turn wrote into its last block (partial-block
        // reuse, which Match does not count)
        assert_eq!(serve(&mut f, GROUP, 2, &next, ""), 8 + 2);
    }

    #[test]
    fn match_follows_the_windowed_pools_rule_of_lease() {
        let mut f = fixture(64);
        // a group with a full-attention pool and a window of 4 tokens
        f.cache
            .register_pool("m/w", 4, &[(0, 64), (4, 64)])
            .unwrap();
        let prompt = tokens(7, 13);
        assert_eq!(
            matched(&mut f, &["m/w"], &[(&prompt[..], "")]).unwrap(),
            vec![vec![0]]
        );
        serve(&mut f, "m/w", 1, &prompt, "");
        let got = matched(&mut f, &["m/w"], &[(&prompt[..], "")]).unwrap()[0][0];
        assert_eq!(got, 12);
        assert_eq!(serve(&mut f, "m/w", 2, &prompt, ""), got);
    }

    #[test]
    fn match_changes_neither_eviction_order_nor_statistics() {
        // Two twins serve the same history; one of them is asked Match for
        // the oldest cached prompt again and again. A later lease that must
        // evict evicts the same blocks in both, and the figures agree.
        let old = tokens(1_000, 8);
        let new = tokens(2_000, 8);
        let big = tokens(3_000, 16);
        let both = [(&old[..], ""), (&new[..], "")];
        let mut twins = [fixture(6), fixture(6)];
        for f in &mut twins {
            serve(f, GROUP, 1, &old, "");
            serve(f, GROUP, 2, &new, "");
        }
        let stats_before = twins[0].cache.stats(None).unwrap();
        for _ in 0..5 {
            assert_eq!(
                matched(&mut twins[0], &[GROUP], &both).unwrap(),
                vec![vec![4], vec![4]]
            );
        }
        assert_eq!(
            twins[0].cache.stats(None).unwrap(),
            stats_before,
            "Match moved a counter, a hit rate or the miss-ratio curve"
        );
        // 4 new blocks in a pool of 6 with 4 cached: the 2 least recently
        // used ones (the old prompt's) go, whatever Match looked at
        for f in &mut twins {
            serve(f, GROUP, 3, &big, "");
            let got = matched(f, &[GROUP], &both).unwrap();
            assert_eq!(
                got,
                vec![vec![0], vec![4]],
                "the old prompt was evicted first"
            );
        }
        assert_eq!(
            twins[0].cache.stats(None).unwrap(),
            twins[1].cache.stats(None).unwrap()
        );
    }

    #[test]
    fn match_refuses_malformed_requests_and_other_principals_groups() {
        let mut f = fixture(8);
        f.cache
            .register_pool_for("someone-else", "m/theirs", 4, &[(0, 8, 0)])
            .unwrap();
        let p = tokens(0, 5);
        let invalid = |r: Result<Vec<Vec<u32>>>, field: &str| match r {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(field), "{m}"),
            other => panic!("expected INVALID_ARGUMENT naming {field}, got {other:?}"),
        };
        invalid(matched(&mut f, &[], &[(&p[..], "")]), "pool_groups");
        invalid(matched(&mut f, &[GROUP], &[]), "prompts");
        invalid(
            matched(&mut f, &[GROUP], &[(&p[..], ""), (&[][..], "")]),
            "prompts[1].prompt_tokens",
        );
        assert!(matches!(
            matched(&mut f, &["m/none"], &[(&p[..], "")]),
            Err(Error::UnknownGroup(g)) if g == "m/none"
        ));
        assert!(matches!(
            matched(&mut f, &[GROUP, "m/theirs"], &[(&p[..], "")]),
            Err(Error::GroupNotOwned { group, .. }) if group == "m/theirs"
        ));
        assert!(matches!(
            f.cache
                .match_prefixes(f.session, Epoch(99), &[GROUP.into()], &[], f.now),
            Err(Error::StaleEpoch { .. })
        ));
    }
}
