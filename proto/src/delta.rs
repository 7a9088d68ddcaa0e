//! The one rule a client applies to an `ExtendResponse` table delta
//! (`cache.proto`, `ExtendResponse.results`): the blocks before the delta's
//! `first_block` slid out of the window, and the delta's block ids were
//! appended. The scheduler keeps its tables with it; the cache's property
//! tests check with it that a client's merged view equals the cache's own.

/// Applies one delta to a full table given as its first block index and its
/// block ids in sequence order.
pub fn apply_table_delta<B: Copy>(
    first_block: &mut u32,
    block_ids: &mut Vec<B>,
    delta_first_block: u32,
    delta_block_ids: &[B],
) {
    let slid = delta_first_block.saturating_sub(*first_block) as usize;
    block_ids.drain(..slid.min(block_ids.len()));
    *first_block = (*first_block).max(delta_first_block);
    block_ids.extend_from_slice(delta_block_ids);
}

#[cfg(test)]
mod tests {
    use super::apply_table_delta;

    #[test]
    fn a_delta_slides_out_the_blocks_before_its_first_and_appends_its_own() {
        let (mut first, mut ids) = (2, vec![10, 11, 12]);
        apply_table_delta(&mut first, &mut ids, 3, &[13]);
        assert_eq!((first, ids.as_slice()), (3, &[11, 12, 13][..]));
    }

    #[test]
    fn a_delta_that_slides_nothing_only_appends() {
        let (mut first, mut ids) = (0, vec![1]);
        apply_table_delta(&mut first, &mut ids, 0, &[2, 3]);
        assert_eq!((first, ids.as_slice()), (0, &[1, 2, 3][..]));
        apply_table_delta(&mut first, &mut ids, 0, &[]);
        assert_eq!(ids, [1, 2, 3]);
    }

    #[test]
    fn a_slide_past_every_held_block_empties_the_table() {
        let (mut first, mut ids) = (0, vec![1, 2]);
        apply_table_delta(&mut first, &mut ids, 5, &[7]);
        assert_eq!((first, ids.as_slice()), (5, &[7][..]));
    }
}
