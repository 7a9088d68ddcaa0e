//! Prompt-lookup speculative decoding: drafts are the tokens that followed
//! the most recent earlier occurrence of the context's last n-gram, and the
//! worker verifies them in one forward pass (argmax at every position).
//!
//! Verification accepts the longest prefix of the drafts that equals the
//! model's own argmax, then takes the model's token after it, so the output is
//! exactly the greedy output; only the number of forward passes changes.

/// Longest n-gram tried when looking for a draft.
pub(crate) const MAX_NGRAM: usize = 3;

/// Up to `k` draft tokens for `context` (prompt and generated tokens, the
/// last one being the token fed next). Empty when no n-gram of length
/// `MAX_NGRAM` down to 1 occurs earlier in the context.
pub(crate) fn draft(context: &[u32], k: usize) -> Vec<u32> {
    if k == 0 || context.len() < 2 {
        return Vec::new();
    }
    let len = context.len();
    for n in (1..=MAX_NGRAM.min(len - 1)).rev() {
        let suffix = &context[len - n..];
        // the most recent earlier occurrence whose continuation is known
        for start in (0..len - n).rev() {
            if &context[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                if from < to {
                    return context[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

/// Verifies `drafts` against the worker's argmax after each fed position
/// (`argmax.len() == drafts.len() + 1`: the fed token, then each draft).
/// Returns how many drafts were accepted and the tokens to emit: the accepted
/// drafts and the model's token after them. `None` when `argmax` is too short.
pub(crate) fn verify(drafts: &[u32], argmax: &[u32]) -> Option<(usize, Vec<u32>)> {
    if argmax.len() < drafts.len() + 1 {
        return None;
    }
    let accepted = drafts
        .iter()
        .zip(argmax)
        .take_while(|(d, a)| d == a)
        .count();
    let mut emit = drafts[..accepted].to_vec();
    emit.push(argmax[accepted]);
    Some((accepted, emit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_follows_most_recent_longest_match() {
        // "a b c d a b" -> trigram? no; bigram "a b" occurs at 0 -> "c d"
        assert_eq!(draft(&[1, 2, 3, 4, 1, 2], 2), vec![3, 4]);
        // most recent occurrence wins
        assert_eq!(draft(&[1, 5, 1, 6, 1], 1), vec![6]);
        // continuation clipped at the end of the context
        assert_eq!(draft(&[7, 8, 7], 4), vec![8, 7]);
        assert!(draft(&[1, 2, 3], 3).is_empty());
        assert!(draft(&[1, 1], 0).is_empty());
    }

    #[test]
    fn verify_accepts_matching_prefix_then_model_token() {
        assert_eq!(verify(&[3, 4, 5], &[3, 4, 9, 0]), Some((2, vec![3, 4, 9])));
        assert_eq!(verify(&[3, 4], &[8, 4, 5]), Some((0, vec![8])));
        assert_eq!(verify(&[3, 4], &[3, 4, 5]), Some((2, vec![3, 4, 5])));
        assert_eq!(verify(&[], &[6]), Some((0, vec![6])));
        assert_eq!(verify(&[1, 2], &[1, 2]), None);
    }

    /// Greedy decoding of a toy "model" with and without verification of
    /// prompt-lookup drafts gives the same tokens.
    #[test]
    fn speculative_equals_greedy_on_a_toy_model() {
        let model = |ctx: &[u32]| -> u32 {
            let n = ctx.len() as u32;
            (ctx[ctx.len() - 1] * 7 + n / 5) % 11
        };
        let prompt = vec![1, 2, 3, 1, 2, 3, 4];
        let steps = 40;
        let mut greedy = prompt.clone();
        for _ in 0..steps {
            let t = model(&greedy);
            greedy.push(t);
        }
        let mut spec = prompt.clone();
        let mut t = model(&spec);
        while spec.len() < prompt.len() + steps {
            spec.push(t);
            let drafts = draft(&spec, 4);
            let mut argmax = Vec::new();
            let mut ctx = spec.clone();
            argmax.push(model(&ctx));
            for d in &drafts {
                ctx.push(*d);
                argmax.push(model(&ctx));
            }
            let (_, emit) = verify(&drafts, &argmax).unwrap_or_default();
            let (last, accepted) = emit
                .split_last()
                .map(|(l, a)| (*l, a.to_vec()))
                .unwrap_or((0, vec![]));
            spec.extend(accepted);
            t = last;
        }
        spec.truncate(prompt.len() + steps);
        assert_eq!(spec, greedy);
    }
}
