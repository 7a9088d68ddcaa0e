//! For tests only (the `testing` feature): where the SmolLM2 GGUF that
//! `kvlease model fetch smollm2` caches is, shared by the tests of every
//! crate that run the real model.
//!
//! A test without its model file returns early. `cargo test` hides what a
//! test prints, so that early return counts as a pass: set
//! `KVLEASE_REQUIRE_MODEL=1` (CI does, after fetching the model) and a
//! missing file fails the test instead.

use std::path::PathBuf;

/// The file `kvlease model fetch smollm2` unpacks under the model cache.
pub const SMOLLM2_FILE: &str = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The variable that turns a missing model file into a failure.
pub const REQUIRE_MODEL: &str = "KVLEASE_REQUIRE_MODEL";

/// The SmolLM2 GGUF: `$KVLEASE_SMOLLM2_GGUF`, else the model cache
/// (`$KVLEASE_HOME` or `~/.cache/kvlease/models`). `None` when it is not
/// there, after [`model_missing`].
///
/// # Panics
/// When it is not there and `KVLEASE_REQUIRE_MODEL=1`.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let candidates: Vec<PathBuf> = match std::env::var_os("KVLEASE_SMOLLM2_GGUF") {
        Some(p) => vec![PathBuf::from(p)],
        None => std::env::var_os("KVLEASE_HOME")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvlease/models"))
            })
            .into_iter()
            .map(|home| home.join(SMOLLM2_FILE))
            .collect(),
    };
    let found = candidates.iter().find(|p| p.is_file()).cloned();
    if found.is_none() {
        model_missing(&format!(
            "the SmolLM2 GGUF is not at {candidates:?}; run `kvlease model fetch smollm2` \
             or set KVLEASE_SMOLLM2_GGUF"
        ));
    }
    found
}

/// Says why a test that needs a model file skips: prints `SKIPPED: {why}`,
/// or panics with it when `KVLEASE_REQUIRE_MODEL=1`.
///
/// # Panics
/// When `KVLEASE_REQUIRE_MODEL=1`.
pub fn model_missing(why: &str) {
    model_missing_under(std::env::var(REQUIRE_MODEL).ok().as_deref(), why);
}

fn model_missing_under(require: Option<&str>, why: &str) {
    if require == Some("1") {
        panic!("{why}, and {REQUIRE_MODEL}=1 makes a missing model a failure");
    }
    println!("SKIPPED: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "KVLEASE_REQUIRE_MODEL=1 makes a missing model a failure")]
    fn a_missing_model_fails_when_required() {
        model_missing_under(Some("1"), "no file");
    }

    #[test]
    fn a_missing_model_skips_otherwise() {
        model_missing_under(None, "no file");
        model_missing_under(Some("0"), "no file");
    }
}
