//! KV arena geometry and the ledger of written slots.
//!
//! The memory itself belongs to the backend (host memory for `backend::cpu`,
//! device memory for a GPU backend); this module says where each K/V row lives
//! and remembers which slots hold K/V, so that validation can refuse a pass
//! that would read slots nobody wrote.
//!
//! Layout of one pool: `num_blocks` blocks, each
//! `[layer_in_pool][k|v][kv_head][slot][head_dim]`, so the rows of one
//! (layer, head) inside a block are contiguous.

use crate::error::{Error, Result};
use crate::model::ModelConfig;

/// Bytes of one KV element (the CPU arena stores f32).
pub const KV_ELEM_BYTES: u64 = 4;

/// The geometry of one pool: the layers sharing one window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Window in tokens; 0 = full attention.
    pub window: u32,
    /// Model layers stored in this pool, ascending.
    pub layers: Vec<usize>,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// K/V heads per layer.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl PoolGeometry {
    /// Elements of one block (K and V, every layer of the pool).
    pub fn elems_per_block(&self) -> usize {
        self.layers.len() * 2 * self.num_kv_heads * self.tokens_per_block * self.head_dim
    }

    /// Bytes of one block.
    pub fn bytes_per_block(&self) -> u64 {
        self.elems_per_block() as u64 * KV_ELEM_BYTES
    }

    /// Elements of the whole pool.
    pub fn elems(&self) -> usize {
        self.num_blocks as usize * self.elems_per_block()
    }

    /// Offset of the `head_dim` row of (block, layer slot, K or V, head, slot)
    /// in the pool's array. `kv` is 0 for K and 1 for V.
    pub fn offset(
        &self,
        block: u32,
        layer_slot: usize,
        kv: usize,
        head: usize,
        slot: usize,
    ) -> usize {
        let b = self.tokens_per_block;
        let d = self.head_dim;
        let per_head = b * d;
        let per_kv = self.num_kv_heads * per_head;
        let per_layer = 2 * per_kv;
        block as usize * self.elems_per_block()
            + layer_slot * per_layer
            + kv * per_kv
            + head * per_head
            + slot * d
    }
}

/// Where every layer's KV lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaLayout {
    /// One pool per distinct window, in `ModelConfig::pools` order.
    pub pools: Vec<PoolGeometry>,
    /// For each model layer: (pool index, slot of the layer within the pool).
    pub layer_slots: Vec<(usize, usize)>,
}

impl ArenaLayout {
    /// The layout for `config` with `num_blocks[i]` blocks in pool `i`.
    pub fn new(config: &ModelConfig, num_blocks: &[u32]) -> Self {
        let pools: Vec<PoolGeometry> = config
            .pools()
            .into_iter()
            .zip(num_blocks.iter().copied().chain(std::iter::repeat(0)))
            .map(|(p, n)| PoolGeometry {
                window: p.window,
                layers: p.layers,
                num_blocks: n,
                tokens_per_block: config.tokens_per_block as usize,
                num_kv_heads: config.num_kv_heads,
                head_dim: config.head_dim,
            })
            .collect();
        let mut layer_slots = vec![(0, 0); config.num_layers()];
        for (pool_index, pool) in pools.iter().enumerate() {
            for (slot, &layer) in pool.layers.iter().enumerate() {
                layer_slots[layer] = (pool_index, slot);
            }
        }
        ArenaLayout { pools, layer_slots }
    }

    /// Index of the pool of `window`, if the model has one.
    pub fn pool_of_window(&self, window: u32) -> Option<usize> {
        self.pools.iter().position(|p| p.window == window)
    }

    /// Bytes of every pool together when an element takes `elem_bytes`.
    pub fn bytes_with(&self, elem_bytes: u64) -> u64 {
        self.pools
            .iter()
            .map(|p| p.elems_per_block() as u64 * elem_bytes * u64::from(p.num_blocks))
            .sum()
    }

    /// Bytes of every pool together.
    pub fn bytes(&self) -> u64 {
        self.pools
            .iter()
            .map(|p| p.bytes_per_block() * u64::from(p.num_blocks))
            .sum()
    }
}

/// Which slots of which blocks hold K/V written by a forward pass.
///
/// A write to slot 0 of a block starts a new use of it (positions fill a
/// block in order), so it forgets the block's other slots: K/V left by the
/// block's previous holder never passes for this sequence's.
#[derive(Debug, Clone)]
pub struct SlotLedger {
    tokens_per_block: usize,
    /// 64-bit words of slot flags per block.
    words_per_block: usize,
    /// Per pool, `num_blocks * words_per_block` words; bit `s % 64` of word
    /// `s / 64` of a block is its slot `s`. A decode step checks every slot
    /// its sequences read, so a block's run of slots is one mask test.
    written: Vec<Vec<u64>>,
}

impl SlotLedger {
    /// An empty ledger for `layout`.
    pub fn new(layout: &ArenaLayout) -> Self {
        let tokens_per_block = layout.pools.first().map_or(1, |p| p.tokens_per_block);
        let words_per_block = tokens_per_block.div_ceil(64);
        SlotLedger {
            tokens_per_block,
            words_per_block,
            written: layout
                .pools
                .iter()
                .map(|p| vec![0; p.num_blocks as usize * words_per_block])
                .collect(),
        }
    }

    fn words(&self, pool: usize, block: u32) -> Option<&[u64]> {
        let at = block as usize * self.words_per_block;
        self.written.get(pool)?.get(at..at + self.words_per_block)
    }

    /// Whether `slot` of `block` in `pool` holds K/V.
    pub fn is_written(&self, pool: usize, block: u32, slot: usize) -> bool {
        self.all_written(pool, block, slot..slot + 1)
    }

    /// Whether every slot in `slots` of `block` in `pool` holds K/V.
    pub fn all_written(&self, pool: usize, block: u32, slots: std::ops::Range<usize>) -> bool {
        if slots.end > self.tokens_per_block {
            return false;
        }
        let Some(words) = self.words(pool, block) else {
            return false;
        };
        let mut s = slots.start;
        while s < slots.end {
            let (w, bit) = (s / 64, s % 64);
            let n = (slots.end - s).min(64 - bit);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if words[w] & mask != mask {
                return false;
            }
            s += n;
        }
        true
    }

    /// Makes `to_block` of `pool` in `self` hold K/V exactly in the slots
    /// `from_block` of `pool` does in `from` (a whole-block copy between
    /// the device arena and the host tier, whose ledgers have the same
    /// tokens per block).
    pub fn copy_block(&mut self, pool: usize, to_block: u32, from: &SlotLedger, from_block: u32) {
        let wpb = self.words_per_block;
        let words: Vec<u64> = from
            .words(pool, from_block)
            .map_or_else(|| vec![0; wpb], <[u64]>::to_vec);
        let start = to_block as usize * wpb;
        if let Some(dst) = self
            .written
            .get_mut(pool)
            .and_then(|w| w.get_mut(start..start + wpb))
        {
            dst.copy_from_slice(&words);
        }
    }

    /// Words of the slot flags of one block (which slots hold K/V), as a
    /// disk-tier file keeps them; all clear for a block out of range.
    pub fn block_words(&self, pool: usize, block: u32) -> Vec<u64> {
        self.words(pool, block)
            .map_or_else(|| vec![0; self.words_per_block], <[u64]>::to_vec)
    }

    /// Words of one block's slot flags (`block_words` has as many).
    pub fn words_per_block(&self) -> usize {
        self.words_per_block
    }

    /// Sets the slot flags of one block (a block loaded from disk holds
    /// K/V in exactly the slots its file says). Ignored out of range or
    /// with the wrong number of words.
    pub fn set_block_words(&mut self, pool: usize, block: u32, words: &[u64]) {
        let wpb = self.words_per_block;
        let start = block as usize * wpb;
        if let Some(dst) = self
            .written
            .get_mut(pool)
            .and_then(|w| w.get_mut(start..start + wpb))
            .filter(|d| d.len() == words.len())
        {
            dst.copy_from_slice(words);
        }
    }

    /// Marks the leading `slots` slots of one block as holding K/V and the
    /// rest as not (a block pulled from a peer: whole, or a hand-off's
    /// partly filled last one). Ignored out of range.
    pub fn set_leading(&mut self, pool: usize, block: u32, slots: usize) {
        let slots = slots.min(self.tokens_per_block);
        let words: Vec<u64> = (0..self.words_per_block)
            .map(|w| {
                let slots = slots.saturating_sub(w * 64).min(64);
                if slots == 64 {
                    u64::MAX
                } else {
                    (1u64 << slots) - 1
                }
            })
            .collect();
        self.set_block_words(pool, block, &words);
    }

    /// Records one batch's writes: `(pool, block, slot)` triples. Blocks
    /// written at slot 0 are cleared first.
    pub fn record(&mut self, writes: &[(usize, u32, usize)]) {
        let wpb = self.words_per_block;
        for &(pool, block, slot) in writes {
            if slot == 0 {
                let start = block as usize * wpb;
                if let Some(words) = self
                    .written
                    .get_mut(pool)
                    .and_then(|w| w.get_mut(start..start + wpb))
                {
                    words.fill(0);
                }
            }
        }
        for &(pool, block, slot) in writes {
            if slot >= self.tokens_per_block {
                continue;
            }
            if let Some(word) = self
                .written
                .get_mut(pool)
                .and_then(|w| w.get_mut(block as usize * wpb + slot / 64))
            {
                *word |= 1 << (slot % 64);
            }
        }
    }
}

/// Blocks per pool for `kv_bytes` of arena with elements of `elem_bytes`,
/// split across pools in proportion to their layer counts; `None` when a
/// pool would get no block.
pub fn split_kv_bytes(config: &ModelConfig, kv_bytes: u64, elem_bytes: u64) -> Option<Vec<u32>> {
    let layout = ArenaLayout::new(config, &[]);
    let total_layers = config.num_layers() as u64;
    let blocks: Vec<u32> = layout
        .pools
        .iter()
        .map(|p| {
            let share = kv_bytes / total_layers * p.layers.len() as u64;
            u32::try_from(share / (p.elems_per_block() as u64 * elem_bytes)).unwrap_or(u32::MAX)
        })
        .collect();
    (!blocks.contains(&0)).then_some(blocks)
}

/// Blocks per pool: the budget left after weights and activations, split
/// across pools in proportion to their layer counts (elements of
/// [`KV_ELEM_BYTES`], the CPU arena's).
pub fn plan_blocks(
    config: &ModelConfig,
    budget_bytes: u64,
    weight_bytes: u64,
    activation_bytes: u64,
) -> Result<Vec<u32>> {
    let too_small = Error::MemoryBudget {
        budget_bytes,
        weight_bytes,
        activation_bytes,
    };
    let Some(kv_bytes) = budget_bytes
        .checked_sub(weight_bytes)
        .and_then(|b| b.checked_sub(activation_bytes))
    else {
        return Err(too_small);
    };
    split_kv_bytes(config, kv_bytes, KV_ELEM_BYTES).ok_or(too_small)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_tracks_runs_of_slots_across_words_and_restarts() {
        // 100 slots per block: two words per block.
        let config = ModelConfig {
            layer_windows: vec![0],
            tokens_per_block: 100,
            ..ModelConfig::small()
        };
        let layout = ArenaLayout::new(&config, &[4]);
        let mut ledger = SlotLedger::new(&layout);
        assert!(!ledger.is_written(0, 2, 0));
        ledger.record(&(0..90).map(|s| (0, 2, s)).collect::<Vec<_>>());
        assert!(ledger.all_written(0, 2, 0..90));
        assert!(ledger.all_written(0, 2, 60..70));
        assert!(!ledger.all_written(0, 2, 0..91));
        assert!(!ledger.all_written(0, 1, 0..1));
        assert!(!ledger.all_written(0, 2, 95..101), "past the block");
        assert!(!ledger.all_written(0, 9, 0..1), "past the pool");
        // A write at slot 0 starts the block over.
        ledger.record(&[(0, 2, 0)]);
        assert!(ledger.is_written(0, 2, 0));
        assert!(!ledger.all_written(0, 2, 0..2));
    }

    #[test]
    fn kv_bytes_are_split_by_layer_count_within_the_budget() {
        let config = ModelConfig {
            layer_windows: vec![0, 64, 64, 64],
            ..ModelConfig::small()
        };
        let (budget, weights, activations) = (10 << 20, 1 << 20, 1 << 20);
        let blocks =
            plan_blocks(&config, budget, weights, activations).unwrap_or_else(|e| panic!("{e}"));
        let layout = ArenaLayout::new(&config, &blocks);
        let bytes: Vec<u64> = layout
            .pools
            .iter()
            .map(|p| p.bytes_per_block() * u64::from(p.num_blocks))
            .collect();
        let kv = budget - weights - activations;
        assert!(bytes.iter().sum::<u64>() <= kv);
        // One layer's share versus three layers' share.
        assert!(bytes[0] <= kv / 4 && bytes[0] + layout.pools[0].bytes_per_block() > kv / 4);
        assert!(
            bytes[1] <= kv / 4 * 3 && bytes[1] + layout.pools[1].bytes_per_block() > kv / 4 * 3
        );
    }

    #[test]
    fn a_budget_without_room_for_kv_is_refused() {
        let config = ModelConfig::small();
        assert!(matches!(
            plan_blocks(&config, 3 << 20, 2 << 20, 1 << 20),
            Err(Error::MemoryBudget { .. })
        ));
        assert!(matches!(
            plan_blocks(&config, 1 << 20, 2 << 20, 0),
            Err(Error::MemoryBudget { .. })
        ));
    }
}
