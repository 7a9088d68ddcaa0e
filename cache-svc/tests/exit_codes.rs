//! The binary's exit codes, the same in all three services: 64 for a usage
//! or configuration error (before anything starts), 0 for `--help`.

use kvlease_runtime::process::exit_code_of;

const BIN: &str = env!("CARGO_BIN_EXE_kvlease-cache");

#[test]
fn usage_and_configuration_errors_exit_64() {
    assert_eq!(exit_code_of(BIN, &["--no-such-flag"]), Some(64));
    assert_eq!(exit_code_of(BIN, &["--max-batch", "0"]), Some(64));
    assert_eq!(exit_code_of(BIN, &["--help"]), Some(0));
}
