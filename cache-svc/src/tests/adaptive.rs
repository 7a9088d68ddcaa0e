//! An adaptive pool through the whole cache: it switches policy under real
//! leases and releases, and every invariant holds before and after.

use super::{Fixture, spec, tokens};
use crate::cache::CacheConfig;
use crate::eviction::{EvictionConfig, PolicyKind};
use crate::lease::Prompt;

/// Writes what the fmt subscriber prints into a shared buffer.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn invariant_an_adaptive_pool_switches_policy_and_stays_whole() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // 64 blocks of 4 tokens. 32 hot one-block prompts, each followed by a
    // one-off 4-block scan: an LRU of 64 blocks never keeps a hot block
    // (160 blocks pass between two uses), frequency and reuse do.
    let config = CacheConfig {
        eviction: EvictionConfig {
            default: PolicyKind::Adaptive,
            groups: Vec::new(),
        },
        partial_reuse: false,
        ..CacheConfig::default()
    };
    let mut f = Fixture::with_config(config, 4, &[(0, 64)]);
    let mut step = 0;
    let mut seq = 0;
    let mut hits_late = 0;
    for cycle in 0..3_000u32 {
        for prompt in [
            tokens(1_000 * (cycle % 32), 5),
            tokens(1_000_000 + 20 * cycle, 17),
        ] {
            step += 1;
            seq += 1;
            let out = f.lease(step, false, &[spec(seq, Prompt::Tokens(prompt))]);
            let granted = out[0].grant().map(|g| g.reused_tokens);
            assert!(granted.is_some(), "cycle {cycle}: {out:?}");
            if cycle >= 2_000 {
                hits_late += granted.unwrap_or(0) / 4;
            }
            f.complete(step);
            f.release(&[seq], None);
        }
    }
    let stats = f.cache.stats(None).unwrap_or_else(|e| panic!("{e}"));
    let policy = &stats.pools[0].policy;
    assert_eq!(policy.configured, PolicyKind::Adaptive);
    assert_ne!(policy.current, PolicyKind::Lru, "{policy:?}");
    assert!(policy.switches >= 1, "{policy:?}");
    // most hot prompts of the last 1,000 cycles hit
    assert!(hits_late > 800, "{hits_late} hits in 1,000 hot prompts");
    // each switch is an event of the call that decided it
    let text = captured
        .0
        .lock()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let events: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("eviction policy switched"))
        .collect();
    assert_eq!(events.len() as u64, policy.switches, "{text}");
    assert!(
        events[0].contains("from=\"lru\"") || events[0].contains("from=lru"),
        "{}",
        events[0]
    );
}
