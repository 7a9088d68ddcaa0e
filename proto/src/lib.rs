//! The `kvlease.v1` protocol: the cache, worker and scheduler services.
//!
//! The `.proto` files under `kvlease/v1/` are the source of truth; this crate
//! holds the code generated from them and the descriptor set that gRPC
//! reflection serves.

#![allow(unreachable_pub, missing_debug_implementations, clippy::all)]

/// Generated messages and services of package `kvlease.v1`. Their docs are
/// the .proto comments, written as prose rather than rustdoc markup.
#[allow(rustdoc::all)]
pub mod v1 {
    tonic::include_proto!("kvlease.v1");
}

pub mod delta;

/// Encoded `FileDescriptorSet` of every kvlease proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvlease_descriptor.bin"));
