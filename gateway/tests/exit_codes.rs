//! The binary's exit codes, the same as the services': 64 for a usage or
//! configuration error (before anything starts), 0 for `--help`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use kvlease_runtime::process::exit_code_of;

const BIN: &str = env!("CARGO_BIN_EXE_kvlease-gateway");

#[test]
fn usage_and_configuration_errors_exit_64() {
    assert_eq!(exit_code_of(BIN, &["--no-such-flag"]), Some(64));
    assert_eq!(exit_code_of(BIN, &["--model", " "]), Some(64));
    assert_eq!(exit_code_of(BIN, &["--default-max-tokens", "0"]), Some(64));
    assert_eq!(
        exit_code_of(BIN, &["--scheduler-addr", "not a url"]),
        Some(64)
    );
    assert_eq!(exit_code_of(BIN, &["--help"]), Some(0));
}

#[test]
fn an_address_in_use_exits_64() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    assert_eq!(exit_code_of(BIN, &["--listen", &addr]), Some(64));
}

#[test]
fn a_bad_log_filter_exits_64() {
    // RUST_LOG is configuration too; exit_code_of clears the rest of the environment
    let out = std::process::Command::new(BIN)
        .env_clear()
        .env("RUST_LOG", "[[not a filter")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
}
