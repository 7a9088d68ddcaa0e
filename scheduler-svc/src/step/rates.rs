//! Peer pull's rates as this scheduler measures them: the link rate from
//! what its workers' pulls moved, the prefill rate from its passes that
//! were mostly prefill. Each is a running mean that replaces the configured
//! rate (`--peer-link-bytes-per-s`, `--peer-prefill-tokens-per-s`) once it
//! has a sample, so a grant weighs a pull against recomputing at what this
//! fleet does, not at what a flag guessed.

use crate::domain::PeerRates;

/// Weight of the newest sample in the running mean.
const NEWEST: f64 = 0.25;

/// Fewest prefill tokens a pass needs to be a sample of the prefill rate
/// (below it, launch and per-pass costs dominate its time).
pub(super) const MIN_PREFILL_TOKENS: u64 = 256;

/// Which configured rates stay fixed (given by the operator) rather than
/// follow the measured ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedRates {
    pub link: bool,
    pub prefill: bool,
}

/// The rates measured so far (`None`: no sample yet).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct MeasuredRates {
    link_bytes_per_s: Option<f64>,
    prefill_tokens_per_s: Option<f64>,
}

fn mean(rate: &mut Option<f64>, sample: f64) {
    *rate = Some(match *rate {
        Some(r) => r + NEWEST * (sample - r),
        None => sample,
    });
}

impl MeasuredRates {
    /// A pull moved `bytes` in `micros`.
    pub(super) fn pulled(&mut self, bytes: u64, micros: u64) {
        if bytes > 0 && micros > 0 {
            mean(
                &mut self.link_bytes_per_s,
                bytes as f64 * 1e6 / micros as f64,
            );
        }
    }

    /// A pass of `tokens` tokens, `prefill` of them prompt tokens, took
    /// `micros` of the worker's compute; a sample of the prefill rate when
    /// it was mostly prefill (three quarters of its tokens, at least
    /// [`MIN_PREFILL_TOKENS`]) and pulled nothing (a pull's time is in the
    /// pass's).
    pub(super) fn computed(&mut self, tokens: u64, prefill: u64, micros: u64, pulled: bool) {
        if micros > 0 && !pulled && prefill >= MIN_PREFILL_TOKENS && 4 * prefill >= 3 * tokens {
            mean(
                &mut self.prefill_tokens_per_s,
                tokens as f64 * 1e6 / micros as f64,
            );
        }
    }

    /// `configured`, with each rate measured so far in place of its
    /// starting value, unless `pinned`.
    pub(super) fn over(&self, configured: PeerRates, pinned: PinnedRates) -> PeerRates {
        let rate = |measured: Option<f64>, pinned: bool, flag: u64| match measured {
            Some(r) if !pinned => (r.round() as u64).max(1),
            _ => flag,
        };
        PeerRates {
            link_bytes_per_s: rate(
                self.link_bytes_per_s,
                pinned.link,
                configured.link_bytes_per_s,
            ),
            prefill_tokens_per_s: rate(
                self.prefill_tokens_per_s,
                pinned.prefill,
                configured.prefill_tokens_per_s,
            ),
            overhead_us: configured.overhead_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGS: PeerRates = PeerRates {
        link_bytes_per_s: 1_000_000_000,
        prefill_tokens_per_s: 4_000,
        overhead_us: 1_000,
    };

    #[test]
    fn measured_rates_replace_the_flags_one_by_one_as_samples_come() {
        let mut m = MeasuredRates::default();
        assert_eq!(m.over(FLAGS, PinnedRates::default()), FLAGS);
        // 47 MB in 30 ms: 1.5 GB/s
        m.pulled(45_000_000, 30_000);
        let r = m.over(FLAGS, PinnedRates::default());
        assert_eq!(r.link_bytes_per_s, 1_500_000_000);
        assert_eq!(r.prefill_tokens_per_s, 4_000, "no prefill sample yet");
        assert_eq!(r.overhead_us, 1_000);
        // 2,048 prompt tokens in 20 ms: 102,400 tokens/s
        m.computed(2_048, 2_048, 20_000, false);
        assert_eq!(
            m.over(FLAGS, PinnedRates::default()).prefill_tokens_per_s,
            102_400
        );
        // the next sample moves the mean a quarter of the way
        m.pulled(3_000_000_000, 1_000_000);
        assert_eq!(
            m.over(FLAGS, PinnedRates::default()).link_bytes_per_s,
            1_875_000_000
        );
        // a rate given on the command line stays as given
        let pinned = PinnedRates {
            link: true,
            prefill: false,
        };
        assert_eq!(
            m.over(FLAGS, pinned).link_bytes_per_s,
            FLAGS.link_bytes_per_s
        );
        assert_eq!(m.over(FLAGS, pinned).prefill_tokens_per_s, 102_400);
        let both = PinnedRates {
            link: true,
            prefill: true,
        };
        assert_eq!(m.over(FLAGS, both), FLAGS);
    }

    #[test]
    fn decode_passes_small_passes_and_passes_with_pulls_are_no_prefill_sample() {
        let mut m = MeasuredRates::default();
        m.computed(256, 0, 3_000, false); // decode
        m.computed(400, 200, 3_000, false); // half prefill
        m.computed(100, 100, 1_000, false); // too few tokens
        m.computed(2_048, 2_048, 20_000, true); // pulled: its time is in there
        m.computed(2_048, 2_048, 0, false); // no time reported
        m.pulled(0, 10);
        m.pulled(10, 0);
        assert_eq!(m, MeasuredRates::default());
        // mostly prefill: counted, its decode rows with it
        m.computed(1_000, 800, 10_000, false);
        assert_eq!(
            m.over(FLAGS, PinnedRates::default()).prefill_tokens_per_s,
            100_000
        );
    }
}
