//! How many blocks a request shape takes over its whole life, in closed form.
//!
//! This is deliberately a second, independent derivation of what the lease
//! code does step by step; a property test holds the two equal (invariant 6).
//!
//! The life of a shape with prompt `P`, `n` output tokens, `e` extra slots and
//! beam width `b`: one `Lease` of `P` tokens, then `n - 1` `Extend`s of one
//! token (the last output token is never fed back), so the final length is
//! `L = P + n - 1` and the lease covers `L + e` slots. Blocks wholly before
//! the last prompt token are shared by the beams (or the branches forked
//! from one parent); the rest are per beam, the block holding the last
//! prompt token included: each beam computes that token itself. In a pool of
//! window `W`, blocks that slide out are released, so fewer are held at once
//! (`peak`) than are taken over the life (`total`).

/// One request shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Prompt tokens (>= 1).
    pub prompt: u32,
    /// Output tokens (0 is read as 1).
    pub max_new_tokens: u32,
    /// Draft + extra KV + extra decoding steps.
    pub extra: u32,
    /// Beam width (0 is read as 1).
    pub beam_width: u32,
}

/// Blocks of one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PoolNeed {
    /// Taken by the lease and every extend of the life.
    pub total: u32,
    /// Most held at once.
    pub peak: u32,
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Blocks held by a table covering block indices `[first, end)` where indices
/// below `shared_end` are shared by the `beams`.
fn held(first: u64, end: u64, shared_end: u64, beams: u64) -> u64 {
    let shared = shared_end.min(end).saturating_sub(first);
    let per_beam = end.saturating_sub(shared_end.max(first));
    shared + beams * per_beam
}

/// The blocks `shape` needs in a pool of `window` (0 = full attention) with
/// `tokens_per_block` tokens per block. Saturates at `u32::MAX`.
pub(crate) fn pool_need(shape: Shape, window: u32, tokens_per_block: u32) -> PoolNeed {
    let b = u64::from(tokens_per_block.max(1));
    let beams = u64::from(shape.beam_width.max(1));
    let prompt = u64::from(shape.prompt);
    let extra = u64::from(shape.extra);
    let final_len = prompt + u64::from(shape.max_new_tokens.max(1)) - 1;
    // beams share the blocks wholly before the last prompt token (each
    // computes it); one beam's blocks are all its own anyway
    let shared_end = if beams > 1 {
        (prompt - 1) / b
    } else {
        prompt / b
    };
    let total = held(0, ceil_div(final_len + extra, b), shared_end, beams);
    let mut peak = held(0, ceil_div(prompt + extra, b), shared_end, beams);
    if window > 0 && final_len > prompt {
        let w = u64::from(window);
        // After the extend that grows the length from `len` to `len + 1`, the
        // table covers [floor((len - W + 1) / B), ceil((len + 1 + e) / B)).
        // Below len = W - 1 that only grows. Once the window has also passed
        // the shared prompt blocks (len >= shared_end * B + W - 1) it is
        // periodic in `len` with period B, so one period past that point
        // covers the maximum.
        let last = final_len - 1;
        let lo = prompt.max(w.saturating_sub(2).min(last));
        let hi = last.min(prompt.max(w.saturating_sub(1)).max(shared_end * b + w) + b);
        for len in lo..=hi {
            let first = (len + 1).saturating_sub(w) / b;
            let end = ceil_div(len + 1 + extra, b);
            peak = peak.max(held(first, end, shared_end, beams));
        }
    } else {
        peak = total;
    }
    let clamp = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    PoolNeed {
        total: clamp(total),
        peak: clamp(peak),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prompt: u32, max_new_tokens: u32, extra: u32, beam_width: u32) -> Shape {
        Shape {
            prompt,
            max_new_tokens,
            extra,
            beam_width,
        }
    }

    #[test]
    fn full_attention_counts_prompt_output_and_extra() {
        // 32 + 16 - 1 = 47 tokens, + 4 draft slots = 51 -> 4 blocks of 16.
        assert_eq!(
            pool_need(shape(32, 16, 4, 1), 0, 16),
            PoolNeed { total: 4, peak: 4 }
        );
        // Without the extra slots it would be 3: the warm-up defect.
        assert_eq!(pool_need(shape(32, 16, 0, 1), 0, 16).total, 3);
    }

    #[test]
    fn beams_share_the_prompt_blocks() {
        // Prompt 40 = 2 full shared blocks; 40+9 = 49 -> 4 blocks, 2 per beam.
        assert_eq!(pool_need(shape(40, 10, 0, 3), 0, 16).total, 2 + 3 * 2);
    }

    #[test]
    fn window_peak_is_bounded() {
        let need = pool_need(shape(16, 1000, 0, 1), 64, 16);
        assert_eq!(need.total, 64); // 1015 tokens -> 64 blocks over the life
        assert!(need.peak <= 64 / 16 + 1, "{need:?}");
    }
}
