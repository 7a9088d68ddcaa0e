//! The binary's exit codes, the same in all three services: 64 for a usage
//! or configuration error (before anything starts), 0 for `--help`.

use kvlease_runtime::process::exit_code_of;

const BIN: &str = env!("CARGO_BIN_EXE_kvlease-worker");

#[test]
fn usage_and_configuration_errors_exit_64() {
    assert_eq!(exit_code_of(BIN, &["--no-such-flag"]), Some(64));
    assert_eq!(exit_code_of(BIN, &["--layer-windows", "0,64,0"]), Some(64));
    // the CPU arena is f32: an fp8 one is the GPU's alone
    let fp8_on_cpu = [
        "--backend",
        "cpu",
        "--kv-dtype",
        "fp8",
        "--listen",
        "127.0.0.1:0",
    ];
    assert_eq!(exit_code_of(BIN, &fp8_on_cpu), Some(64));
    assert_eq!(exit_code_of(BIN, &["--help"]), Some(0));
}
