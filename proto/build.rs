//! Compiles `kvlease/v1/*.proto` with protox (a pure-Rust protobuf compiler,
//! so no system `protoc` is needed) and generates the tonic/prost code. The
//! descriptor set is also written out for gRPC reflection.

use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &[
    "kvlease/v1/cache.proto",
    "kvlease/v1/worker.proto",
    "kvlease/v1/scheduler.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out_dir.join("kvlease_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
