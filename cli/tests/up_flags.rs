//! Flags of `kvlease up` that reach the services it starts, read from the
//! binary's own help.

use std::process::Command;

fn up_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["up", "--help"])
        .output()
        .unwrap_or_else(|e| panic!("run kvlease: {e}"));
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The scheduler's step sampling is `kvlease up`'s too: the flag, and the
/// variable the standalone scheduler reads (which `up` used to ignore).
#[test]
fn up_takes_the_step_trace_sampling() {
    let help = up_help();
    assert!(help.contains("--trace-steps-one-in"), "{help}");
    assert!(help.contains("KVLEASE_TRACE_STEPS_ONE_IN"), "{help}");
}
