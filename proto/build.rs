//! Compiles `kvlease/v1/*.proto` with protox (a pure-Rust protobuf compiler,
//! so no system `protoc` is needed) and generates the tonic/prost code. The
//! descriptor set is also written out for gRPC reflection and for the
//! codec's check of 32-bit fields.

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
    // `prost::Name` for every message, so that the codec finds a message's
    // fields in the descriptor set by its name
    let mut prost = prost_build::Config::new();
    prost.enable_type_names();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's codec plus the 32-bit range check (src/codec.rs)
        .codec_path("crate::codec::Codec")
        .compile_fds_with_config(fds, prost)?;
    Ok(())
}
