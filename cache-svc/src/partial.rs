//! Partly filled blocks kept for partial-block reuse.
//!
//! A conversation's next turn usually repeats the previous turn's whole
//! context, which ended mid-block. Full blocks are found by their chained
//! hash (`prefix`); the last, partly filled block has no hash, so it is kept
//! here instead: keyed by the hash of the full block before it (its parent)
//! and the salt, with its token ids. A new prompt whose full blocks match up
//! to that parent compares its next tokens with each candidate's, token by
//! token, so a match is exact (no hash of the partial tokens is trusted) and
//! may be any prefix of the kept tokens.
//!
//! A kept block is *cached* in its pool (evictable like a published block,
//! always a leaf). It is never shared in a table: a lease that matches it
//! gets a fresh block and a copy instruction for the matching slots.
//!
//! Entries are *pending* from the release that keeps them until the step
//! that wrote the block's last token completes, like a full block's hash.

use foldhash::{HashMap, HashMapExt};

use crate::ids::BlockId;

/// Candidates kept per (parent, salt): a lookup compares each, so the list
/// stays short; a block beyond it is simply not kept.
pub(crate) const MAX_PER_PARENT: usize = 4;

#[derive(Clone, Debug)]
struct Entry {
    parent: u64,
    salt: u64,
    tokens: Vec<u32>,
    published: bool,
}

/// The partly filled blocks of one pool, pending or published.
#[derive(Debug, Default)]
pub(crate) struct PartialIndex {
    entries: HashMap<BlockId, Entry>,
    by_parent: HashMap<(u64, u64), Vec<BlockId>>,
}

impl PartialIndex {
    pub(crate) fn new() -> Self {
        Self {
            entries: HashMap::new(),
            by_parent: HashMap::new(),
        }
    }

    /// Records what `block` will hold once published.
    pub(crate) fn set_pending(&mut self, block: BlockId, parent: u64, salt: u64, tokens: Vec<u32>) {
        self.remove(block);
        self.entries.insert(
            block,
            Entry {
                parent,
                salt,
                tokens,
                published: false,
            },
        );
    }

    /// Whether `block` has a pending entry.
    #[cfg(test)]
    pub(crate) fn is_pending(&self, block: BlockId) -> bool {
        self.entries.get(&block).is_some_and(|e| !e.published)
    }

    /// Publishes `block`'s pending entry. Returns false (and drops the entry)
    /// when its parent already has [`MAX_PER_PARENT`] candidates.
    pub(crate) fn publish(&mut self, block: BlockId) -> bool {
        let Some(entry) = self.entries.get_mut(&block) else {
            return false;
        };
        let list = self
            .by_parent
            .entry((entry.parent, entry.salt))
            .or_default();
        if list.len() >= MAX_PER_PARENT {
            self.entries.remove(&block);
            return false;
        }
        list.push(block);
        entry.published = true;
        true
    }

    /// Forgets `block` (pending or published).
    pub(crate) fn remove(&mut self, block: BlockId) {
        let Some(entry) = self.entries.remove(&block) else {
            return;
        };
        if entry.published {
            let key = (entry.parent, entry.salt);
            if let Some(list) = self.by_parent.get_mut(&key) {
                list.retain(|&b| b != block);
                if list.is_empty() {
                    self.by_parent.remove(&key);
                }
            }
        }
    }

    /// The published block after `parent` (with `salt`) whose leading token
    /// ids match the most of `tokens`, with that count (> 0).
    pub(crate) fn find(&self, parent: u64, salt: u64, tokens: &[u32]) -> Option<(BlockId, u32)> {
        let list = self.by_parent.get(&(parent, salt))?;
        list.iter()
            .filter_map(|&block| {
                let kept = &self.entries.get(&block)?.tokens;
                let k = kept.iter().zip(tokens).take_while(|(a, b)| a == b).count();
                (k > 0).then_some((block, k as u32))
            })
            .max_by_key(|&(block, k)| (k, std::cmp::Reverse(block)))
    }

    /// Published entries.
    pub(crate) fn published(&self) -> usize {
        self.by_parent.values().map(Vec::len).sum()
    }

    /// Checks that the published entries and the by-parent lists agree, and
    /// that `is_published(block)` and `is_pending(block)` say the same as
    /// the index.
    pub(crate) fn check(
        &self,
        is_published: impl Fn(BlockId) -> bool,
        is_pending: impl Fn(BlockId) -> bool,
    ) -> Result<(), String> {
        for (&(parent, salt), list) in &self.by_parent {
            for &b in list {
                match self.entries.get(&b) {
                    Some(e) if e.published && e.parent == parent && e.salt == salt => {}
                    _ => return Err(format!("partial list of {parent:#x} names stale block {b}")),
                }
            }
        }
        for (&b, e) in &self.entries {
            if e.published != is_published(b) || e.published == is_pending(b) {
                return Err(format!(
                    "partial block {b}: index says published={}, pool disagrees",
                    e.published
                ));
            }
        }
        let published = self.entries.values().filter(|e| e.published).count();
        if published != self.published() {
            return Err(format!(
                "{published} published partial entries, {} listed",
                self.published()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_exact_token_match_under_the_parent_and_salt() {
        let mut p = PartialIndex::new();
        p.set_pending(1, 7, 0, vec![1, 2, 3]);
        p.set_pending(2, 7, 0, vec![1, 2, 9, 9]);
        p.set_pending(3, 7, 5, vec![1, 2, 3, 4]);
        assert_eq!(
            p.find(7, 0, &[1, 2, 3]),
            None,
            "pending entries are not found"
        );
        assert!(p.publish(1) && p.publish(2) && p.publish(3));
        assert_eq!(p.find(7, 0, &[1, 2, 3, 4, 5]), Some((1, 3)));
        assert_eq!(p.find(7, 0, &[1, 2, 9]), Some((2, 3)));
        assert_eq!(
            p.find(7, 0, &[1, 8]),
            Some((1, 1)),
            "ties go to the lower id"
        );
        assert_eq!(p.find(7, 0, &[4]), None);
        assert_eq!(p.find(8, 0, &[1, 2, 3]), None, "other parent");
        assert_eq!(p.find(7, 5, &[1, 2, 3, 4]), Some((3, 4)), "salt separates");
        p.remove(1);
        assert_eq!(p.find(7, 0, &[1, 2, 3]), Some((2, 2)));
        p.check(|b| b == 2 || b == 3, |_| false).unwrap();
    }

    #[test]
    fn a_full_parent_keeps_no_more_candidates() {
        let mut p = PartialIndex::new();
        for b in 0..MAX_PER_PARENT as BlockId {
            p.set_pending(b, 1, 0, vec![b]);
            assert!(p.publish(b));
        }
        let extra = MAX_PER_PARENT as BlockId;
        p.set_pending(extra, 1, 0, vec![99]);
        assert!(!p.publish(extra));
        assert!(!p.is_pending(extra));
        assert_eq!(p.published(), MAX_PER_PARENT);
        p.check(|b| b < extra, |_| false).unwrap();
    }
}
