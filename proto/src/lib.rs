//! The `kvlease.v1` protocol: the cache, worker and scheduler services.
//!
//! The `.proto` files under `kvlease/v1/` are the source of truth; this crate
//! holds the code generated from them, the descriptor set that gRPC
//! reflection serves, and the codec every generated client and server uses
//! ([`codec`]: prost's, refusing a 32-bit field sent with a larger number
//! instead of truncating it).

#![allow(unreachable_pub, missing_debug_implementations, clippy::all)]

/// Generated messages and services of package `kvlease.v1`. Their docs are
/// the .proto comments, written as prose rather than rustdoc markup.
#[allow(rustdoc::all)]
pub mod v1 {
    tonic::include_proto!("kvlease.v1");
}

pub mod codec;
pub mod delta;

/// Metadata of an `INVALID_ARGUMENT` status naming the `GenerateRequest` field at fault
/// (`max_tokens`, `tokens`, `stop`, ...), so that a front such as the HTTP gateway can name it
/// in its own terms (OpenAI's `param`) without parsing the message.
pub const INVALID_FIELD_METADATA: &str = "kvlease-invalid-field";

/// Encoded `FileDescriptorSet` of every kvlease proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvlease_descriptor.bin"));

/// The protocol's reject reason for `name`, the name both services give their own domain
/// reasons (`"POOL_EXHAUSTED"`, `"EXCEEDS_CAPACITY"`, ...); `REJECT_REASON_UNSPECIFIED` for a
/// name the protocol does not know. The .proto enum is the one list of names: a service maps its
/// domain reason to the protocol through it rather than through a match of its own.
pub fn reject_reason(name: &str) -> v1::RejectReason {
    v1::RejectReason::from_str_name(name).unwrap_or(v1::RejectReason::Unspecified)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reject_reasons_map_by_name_and_unknown_names_are_unspecified() {
        assert_eq!(
            reject_reason("POOL_EXHAUSTED"),
            v1::RejectReason::PoolExhausted
        );
        assert_eq!(
            reject_reason("CACHE_RESTARTED"),
            v1::RejectReason::CacheRestarted
        );
        assert_eq!(
            reject_reason("pool_exhausted"),
            v1::RejectReason::Unspecified
        );
        assert_eq!(reject_reason(""), v1::RejectReason::Unspecified);
        for reason in [
            v1::RejectReason::PoolExhausted,
            v1::RejectReason::ExceedsCapacity,
            v1::RejectReason::RolledBack,
            v1::RejectReason::UnknownSequence,
            v1::RejectReason::DuplicateSequence,
            v1::RejectReason::QuotaExceeded,
        ] {
            assert_eq!(reject_reason(reason.as_str_name()), reason);
        }
    }
}
