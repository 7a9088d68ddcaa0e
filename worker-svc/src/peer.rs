//! Peer pull: whole blocks of one worker's arena streamed to a worker of
//! another group of the same owner, which writes them into its own arena
//! before a forward pass (cache.proto `Grant.peer_copies`).
//!
//! What is plain here: checking a `PullBlocks` request against the
//! source's arena and identity, cutting a block into chunks under the
//! message cap, putting the chunks back together on the other side, and
//! checking a Forward sequence's pull against its own tables. The gRPC
//! calls are in `service.rs`.

use crate::arena::ArenaLayout;
use crate::batch::TableInput;
use crate::error::{Error, Result};

/// Most blocks one pull may name.
pub const MAX_PULL_BLOCKS: usize = 4096;

/// Largest chunk of a block in one message of the stream: well under
/// tonic's default 4 MiB cap on a message.
pub const PULL_CHUNK_BYTES: usize = 1 << 20;

/// The metadata key a pulling worker names the principal it pulls for in
/// (the owner of the Forward that asked for the pull).
pub const PULL_FOR_METADATA: &str = "kvlease-pull-for";

/// Whom a `PullBlocks` call acts for: a caller presenting a `worker`
/// service certificate acts for the principal it names (`pull_for`; itself
/// when it names none), anyone else for itself; the source serves the call
/// only when that is its owner. A client cannot borrow an owner's name:
/// only a worker's certificate, vouched for by the CA, may name one.
pub fn pulls_for<'a>(caller: &'a str, is_worker: bool, pull_for: Option<&'a str>) -> &'a str {
    match (is_worker, pull_for) {
        (true, Some(owner)) => owner,
        _ => caller,
    }
}

/// A block of the source's arena, by its pool's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    /// The pool's window (0: full attention).
    pub window: u32,
    /// The block.
    pub block: u32,
    /// Slots that must hold K/V, from the first (0: every slot).
    pub tokens: u32,
}

/// One block a Forward sequence pulls: `src_block` of the source's pool of
/// `window` into its own `dst_block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerBlockInput {
    /// The pool's window.
    pub window: u32,
    /// The source's block.
    pub src_block: u32,
    /// This worker's block, in the sequence's table.
    pub dst_block: u32,
    /// Slots the copy writes, from the first (0: every slot).
    pub tokens: u32,
}

/// A Forward sequence's peer pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPullInput {
    /// The source worker's endpoint.
    pub address: String,
    /// The grant's transfer id.
    pub transfer_id: u64,
    /// The blocks.
    pub blocks: Vec<PeerBlockInput>,
}

/// Where one pulled block goes (or comes from): `(pool, block, slots)`,
/// the leading `slots` slots holding K/V.
pub type PullTarget = (usize, u32, usize);

/// Checks a `PullBlocks` request on the source: its identity (`have`,
/// as `(tokenizer fingerprint, KV dtype)`) against the puller's (`want`)
/// and every block against the arena. Returns `(pool, block, slots)` per
/// entry.
pub fn check_pull(
    layout: &ArenaLayout,
    have: (&str, &str),
    want: (&str, &str),
    blocks: &[BlockRef],
) -> Result<Vec<PullTarget>> {
    if blocks.is_empty() || blocks.len() > MAX_PULL_BLOCKS {
        return Err(Error::InvalidPull(format!(
            "blocks must name 1 to {MAX_PULL_BLOCKS} blocks, got {}",
            blocks.len()
        )));
    }
    if want.0 != have.0 {
        return Err(Error::Pull(format!(
            "this worker's tokenizer has fingerprint {:?}, the puller's {:?}",
            have.0,
            kvlease_runtime::echo::clip(want.0, 16)
        )));
    }
    if want.1 != have.1 {
        return Err(Error::Pull(format!(
            "this worker's KV is {}, the puller's {:?}",
            have.1,
            kvlease_runtime::echo::clip(want.1, 16)
        )));
    }
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let bad = |why: String| Error::InvalidPull(format!("blocks[{i}]: {why}"));
            let (pool, block) = block_of(layout, b.window, b.block).map_err(bad)?;
            let slots = slots_of(layout, pool, b.tokens).map_err(bad)?;
            Ok((pool, block, slots))
        })
        .collect()
}

/// The slots a copy of `tokens` leading slots covers in a block of
/// `pool` (0: every slot), or why not.
fn slots_of(layout: &ArenaLayout, pool: usize, tokens: u32) -> Result<usize, String> {
    let tpb = layout.pools[pool].tokens_per_block;
    match tokens as usize {
        0 => Ok(tpb),
        t if t <= tpb => Ok(t),
        t => Err(format!("tokens {t} is more than a block's {tpb} slots")),
    }
}

/// The pool of `window` and `block` in it, or why not.
fn block_of(layout: &ArenaLayout, window: u32, block: u32) -> Result<(usize, u32), String> {
    let pool = layout
        .pool_of_window(window)
        .ok_or_else(|| format!("the model has no pool of window {window}"))?;
    let n = layout.pools[pool].num_blocks;
    if block >= n {
        return Err(format!(
            "block {block} is out of range in the pool of window {window} ({n} blocks)"
        ));
    }
    Ok((pool, block))
}

/// The chunks of one block's bytes: `(offset, piece)`, each at most
/// `size` bytes.
pub fn chunks(data: &[u8], size: usize) -> impl Iterator<Item = (u64, &[u8])> {
    let size = size.max(1);
    data.chunks(size)
        .enumerate()
        .map(move |(i, c)| ((i * size) as u64, c))
}

/// Puts a pull's chunks back together: every block in request order, each
/// from offset 0 without gaps, exactly as many bytes as this worker's
/// block of that pool holds.
#[derive(Debug)]
pub struct Assembler {
    expect: Vec<u64>,
    blocks: Vec<Vec<u8>>,
}

impl Assembler {
    /// For blocks of `expect[i]` bytes each.
    pub fn new(expect: Vec<u64>) -> Self {
        Self {
            blocks: Vec::with_capacity(expect.len()),
            expect,
        }
    }

    /// Takes the next chunk, or says what is wrong with it.
    pub fn push(
        &mut self,
        index: u32,
        offset: u64,
        block_bytes: u64,
        data: &[u8],
    ) -> Result<(), String> {
        let index = index as usize;
        let current = self.blocks.len().checked_sub(1);
        let starts_next = offset == 0 && index == self.blocks.len();
        let continues = Some(index) == current
            && self
                .blocks
                .get(index)
                .is_some_and(|b| b.len() as u64 == offset);
        if !starts_next && !continues {
            return Err(format!(
                "chunk of block {index} at offset {offset} is out of order"
            ));
        }
        let Some(&want) = self.expect.get(index) else {
            return Err(format!(
                "chunk of block {index}, but {} were asked for",
                self.expect.len()
            ));
        };
        if block_bytes != want || offset + data.len() as u64 > want {
            return Err(format!(
                "block {index} has {block_bytes} bytes (chunk at {offset} of {}), this worker's {want}",
                data.len()
            ));
        }
        if starts_next {
            if let Some(prev) = current.filter(|&p| self.blocks[p].len() as u64 != self.expect[p]) {
                return Err(format!("block {prev} ended early"));
            }
            self.blocks.push(Vec::with_capacity(want as usize));
        }
        if let Some(b) = self.blocks.last_mut() {
            b.extend_from_slice(data);
        }
        Ok(())
    }

    /// The blocks, once every one is whole.
    pub fn finish(self) -> Result<Vec<Vec<u8>>, String> {
        let whole = self
            .blocks
            .iter()
            .zip(&self.expect)
            .all(|(b, &want)| b.len() as u64 == want);
        if self.blocks.len() != self.expect.len() || !whole {
            let got: usize = self.blocks.iter().map(Vec::len).sum();
            let want: u64 = self.expect.iter().sum();
            return Err(format!(
                "the stream ended after {got} of {want} bytes ({} of {} blocks begun)",
                self.blocks.len(),
                self.expect.len()
            ));
        }
        Ok(self.blocks)
    }
}

/// Checks sequence `seq_id`'s pull against its `tables` and `start_pos`:
/// every block names a pool of the model and blocks in range, and writes
/// slots of a block of its own table that lie before `start_pos` (K/V it
/// reads and does not compute), once. Returns `(pool, dst_block, slots)`
/// per block.
pub fn check_peer_pull(
    layout: &ArenaLayout,
    seq_id: u64,
    start_pos: u32,
    tables: &[TableInput],
    pull: &PeerPullInput,
) -> Result<Vec<PullTarget>> {
    let bad = |why: String| Error::InvalidPull(format!("sequence {seq_id}: peer_pull{why}"));
    if pull.address.is_empty() {
        return Err(bad(".address is empty".into()));
    }
    if pull.blocks.is_empty() || pull.blocks.len() > MAX_PULL_BLOCKS {
        return Err(bad(format!(
            ".blocks must name 1 to {MAX_PULL_BLOCKS} blocks, got {}",
            pull.blocks.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    pull.blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let at = |why: String| bad(format!(".blocks[{i}]: {why}"));
            block_of(layout, b.window, b.src_block).map_err(|w| at(format!("src: {w}")))?;
            let (pool, dst) =
                block_of(layout, b.window, b.dst_block).map_err(|w| at(format!("dst: {w}")))?;
            let slots = slots_of(layout, pool, b.tokens).map_err(at)?;
            let tpb = layout.pools[pool].tokens_per_block as u64;
            let before = tables.iter().filter(|t| t.window == b.window).any(|t| {
                t.block_ids.iter().enumerate().any(|(k, &id)| {
                    id == dst
                        && (u64::from(t.first_block) + k as u64) * tpb + slots as u64
                            <= u64::from(start_pos)
                })
            });
            if !before {
                return Err(at(format!(
                    "dst_block {dst} is not a block of its table for window {} whose {slots} copied slots lie before start_pos {start_pos}",
                    b.window
                )));
            }
            if !seen.insert((pool, dst)) {
                return Err(at(format!("dst_block {dst} is written twice")));
            }
            Ok((pool, dst, slots))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    /// Two pools (full, window 8) of 6 blocks of 4 tokens.
    fn layout() -> ArenaLayout {
        let config = ModelConfig {
            layer_windows: vec![0, 8],
            tokens_per_block: 4,
            ..ModelConfig::small()
        };
        ArenaLayout::new(&config, &[6, 6])
    }

    #[test]
    fn a_pull_is_checked_against_the_sources_identity_and_arena() {
        let l = layout();
        let ok = check_pull(
            &l,
            ("fp", "f32"),
            ("fp", "f32"),
            &[
                BlockRef {
                    window: 8,
                    block: 5,
                    tokens: 0,
                },
                BlockRef {
                    window: 0,
                    block: 0,
                    tokens: 3,
                },
            ],
        );
        // every slot of the first, the leading three of the second
        assert_eq!(ok.unwrap(), vec![(1, 5, 4), (0, 0, 3)]);
        let msg = |r: Result<Vec<PullTarget>>| r.unwrap_err().to_string();
        assert_eq!(
            msg(check_pull(&l, ("fp", "f32"), ("fp", "f32"), &[])),
            "blocks must name 1 to 4096 blocks, got 0"
        );
        let one = [BlockRef {
            window: 0,
            block: 6,
            tokens: 0,
        }];
        assert_eq!(
            msg(check_pull(&l, ("fp", "f32"), ("fp", "f32"), &one)),
            "blocks[0]: block 6 is out of range in the pool of window 0 (6 blocks)"
        );
        let one = [BlockRef {
            window: 4,
            block: 0,
            tokens: 0,
        }];
        assert_eq!(
            msg(check_pull(&l, ("fp", "f32"), ("fp", "f32"), &one)),
            "blocks[0]: the model has no pool of window 4"
        );
        let five = [BlockRef {
            window: 0,
            block: 0,
            tokens: 5,
        }];
        assert_eq!(
            msg(check_pull(&l, ("fp", "f32"), ("fp", "f32"), &five)),
            "blocks[0]: tokens 5 is more than a block's 4 slots"
        );
        let one = [BlockRef {
            window: 0,
            block: 0,
            tokens: 0,
        }];
        let e = check_pull(&l, ("fp", "f32"), ("other", "f32"), &one).unwrap_err();
        assert!(matches!(e, Error::Pull(_)), "{e}");
        assert!(e.to_string().contains("fingerprint"), "{e}");
        let e = check_pull(&l, ("fp", "f32"), ("fp", "bf16"), &one).unwrap_err();
        assert!(e.to_string().contains("KV is f32"), "{e}");
    }

    #[test]
    fn only_a_worker_certificate_may_pull_for_another_principal() {
        assert_eq!(pulls_for("worker", true, Some("sched")), "sched");
        assert_eq!(pulls_for("worker", true, None), "worker");
        assert_eq!(pulls_for("alice", false, Some("sched")), "alice");
        assert_eq!(pulls_for("sched", false, None), "sched");
    }

    #[test]
    fn chunks_reassemble_into_the_blocks_and_every_defect_is_named() {
        let a: Vec<u8> = (0..10).collect();
        let b: Vec<u8> = (100..107).collect();
        let mut asm = Assembler::new(vec![10, 7]);
        for (i, data) in [&a, &b].into_iter().enumerate() {
            let pieces: Vec<_> = chunks(data, 3).collect();
            assert_eq!(pieces.len(), data.len().div_ceil(3));
            for (offset, piece) in pieces {
                asm.push(i as u32, offset, data.len() as u64, piece)
                    .unwrap();
            }
        }
        assert_eq!(asm.finish().unwrap(), vec![a.clone(), b.clone()]);
        // a stream cut short
        let mut asm = Assembler::new(vec![10, 7]);
        asm.push(0, 0, 10, &a[..3]).unwrap();
        assert_eq!(
            asm.finish().unwrap_err(),
            "the stream ended after 3 of 17 bytes (1 of 2 blocks begun)"
        );
        // out of order, a gap, a size that is not this worker's, too many
        let mut asm = Assembler::new(vec![10, 7]);
        assert!(asm.push(1, 0, 7, &b).unwrap_err().contains("out of order"));
        asm.push(0, 0, 10, &a[..3]).unwrap();
        assert!(
            asm.push(0, 4, 10, &a[4..])
                .unwrap_err()
                .contains("out of order")
        );
        assert!(asm.push(1, 0, 7, &b).unwrap_err().contains("ended early"));
        let mut asm = Assembler::new(vec![10]);
        assert!(
            asm.push(0, 0, 12, &a)
                .unwrap_err()
                .contains("this worker's 10")
        );
        asm.push(0, 0, 10, &a).unwrap();
        assert!(
            asm.push(1, 0, 7, &b)
                .unwrap_err()
                .contains("1 were asked for")
        );
    }

    #[test]
    fn a_sequences_pull_writes_only_its_own_blocks_before_start_pos() {
        let l = layout();
        let tables = vec![
            TableInput {
                window: 0,
                beam: 0,
                first_block: 0,
                block_ids: vec![3, 1, 2],
            },
            TableInput {
                window: 8,
                beam: 0,
                first_block: 0,
                block_ids: vec![4, 0, 5],
            },
        ];
        let partial = |blocks: Vec<(u32, u32, u32, u32)>| PeerPullInput {
            address: "http://127.0.0.1:1".into(),
            transfer_id: 7,
            blocks: blocks
                .into_iter()
                .map(|(window, src_block, dst_block, tokens)| PeerBlockInput {
                    window,
                    src_block,
                    dst_block,
                    tokens,
                })
                .collect(),
        };
        let pull = |blocks: Vec<(u32, u32, u32)>| {
            partial(blocks.into_iter().map(|(w, s, d)| (w, s, d, 0)).collect())
        };
        let ok = check_peer_pull(
            &l,
            9,
            8,
            &tables,
            &pull(vec![(0, 5, 3), (0, 4, 1), (8, 1, 0)]),
        );
        assert_eq!(ok.unwrap(), vec![(0, 3, 4), (0, 1, 4), (1, 0, 4)]);
        // a hand-off's last block: its leading slots before start_pos 11
        let ok = check_peer_pull(&l, 9, 11, &tables, &partial(vec![(0, 5, 2, 3)]));
        assert_eq!(ok.unwrap(), vec![(0, 2, 3)]);
        let msg = |p: PeerPullInput| {
            check_peer_pull(&l, 9, 8, &tables, &p)
                .unwrap_err()
                .to_string()
        };
        // block 2 holds positions 8..12: the pass computes those
        assert_eq!(
            msg(pull(vec![(0, 5, 2)])),
            "sequence 9: peer_pull.blocks[0]: dst_block 2 is not a block of its table for window 0 whose 4 copied slots lie before start_pos 8"
        );
        // slots 8..11 of block 2 copied, but the pass starts at 10
        assert!(
            check_peer_pull(&l, 9, 10, &tables, &partial(vec![(0, 5, 2, 3)]))
                .unwrap_err()
                .to_string()
                .contains("whose 3 copied slots lie before start_pos 10")
        );
        assert!(
            msg(partial(vec![(0, 5, 3, 9)])).contains("tokens 9 is more than a block's 4 slots")
        );
        assert!(msg(pull(vec![(0, 5, 0)])).contains("dst_block 0 is not a block of its table"));
        assert!(
            msg(pull(vec![(0, 5, 3), (0, 4, 3)]))
                .contains("blocks[1]: dst_block 3 is written twice")
        );
        assert!(msg(pull(vec![(0, 9, 3)])).contains("blocks[0]: src: block 9 is out of range"));
        assert!(msg(pull(vec![(2, 0, 3)])).contains("no pool of window 2"));
        assert_eq!(
            msg(pull(vec![])),
            "sequence 9: peer_pull.blocks must name 1 to 4096 blocks, got 0"
        );
        let mut p = pull(vec![(0, 5, 3)]);
        p.address.clear();
        assert_eq!(msg(p), "sequence 9: peer_pull.address is empty");
    }
}
