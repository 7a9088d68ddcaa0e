//! The codec of every kvlease call: prost's, with the one check prost leaves
//! out. prost reads a 32-bit field (`uint32`, `int32`, an enum) by cutting
//! the 64-bit number on the wire to 32 bits, so 2^32 + 5 sent where a
//! `uint32` is declared arrives as 5, and a token id, a `max_tokens` or a
//! priority changes meaning without a word (issue 29, point 9). [`Codec`]
//! first reads the message's wire bytes against the protocol's descriptor
//! set and refuses a 32-bit field whose number does not fit, naming the
//! field and its range; then prost decodes as before.
//!
//! The refusal is a decode error like prost's own (`INTERNAL`, "failed to
//! decode Protobuf message: ..."), which every kvlease server answers as
//! `INVALID_ARGUMENT` (the status fix-up of `kvlease-runtime`'s limits), as
//! it does any message that does not decode. `build.rs` names this codec in
//! the generated clients and servers, so responses are checked too.

// The crate allows every clippy lint for the generated code; this module is
// written by hand.
#![warn(clippy::all)]

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::LazyLock;

use prost::Message as _;
use prost::Name;
use prost::bytes::Buf;
use prost_types::field_descriptor_proto::Type;
use prost_types::{DescriptorProto, FileDescriptorSet};
use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic_prost::ProstEncoder;

/// prost's codec, with [`check`] before each decode.
#[derive(Debug, Clone)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Name + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(PhantomData)
    }
}

/// Decodes a `U` whose 32-bit fields all fit ([`check`]).
#[derive(Debug, Clone)]
pub struct CheckedDecoder<U>(PhantomData<U>);

impl<U: prost::Message + Name + Default> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let len = buf.remaining();
        let decoded = if buf.chunk().len() >= len {
            check::<U>(&buf.chunk()[..len]).map_err(refused)?;
            U::decode(buf)
        } else {
            // tonic hands over one contiguous buffer, but nothing promises it
            let whole = buf.copy_to_bytes(len);
            check::<U>(&whole).map_err(refused)?;
            U::decode(whole)
        };
        // as tonic-prost maps prost's errors
        decoded
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

fn refused(e: OutOfRange) -> Status {
    Status::internal(format!("failed to decode Protobuf message: {e}"))
}

// === the check ===

/// A 32-bit field whose number on the wire does not fit in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfRange {
    /// The field's path from the message, e.g.
    /// `LeaseRequest.sequences.max_new_tokens`.
    pub field: String,
    value: Value,
}

/// The number on the wire, read as the field's type reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Value {
    Unsigned(u64),
    Signed(i64),
}

impl OutOfRange {
    /// The same fault, seen from the message that holds `field`.
    fn inside(mut self, field: &str) -> Self {
        self.field = format!("{field}.{}", self.field);
        self
    }
}

impl fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Value::Unsigned(v) => write!(
                f,
                "{} is {v}, over its 32-bit limit of {}",
                self.field,
                u32::MAX
            ),
            Value::Signed(v) => write!(
                f,
                "{} is {v}, outside its 32-bit range {} to {}",
                self.field,
                i32::MIN,
                i32::MAX
            ),
        }
    }
}

/// Checks that every 32-bit field of the message `M` encoded in `wire` fits
/// its type. Bytes that are no valid encoding pass: prost refuses them with
/// its own error. Types outside the `kvlease.v1` package pass unread.
pub fn check<M: Name>(wire: &[u8]) -> Result<(), OutOfRange> {
    if M::PACKAGE != PACKAGE {
        return Ok(());
    }
    let schema = &*SCHEMA;
    match schema.by_name(M::NAME) {
        Some(message) => schema
            .check(message, wire, 0)
            .map_err(|e| e.inside(&schema.messages[message].name)),
        None => Ok(()),
    }
}

const PACKAGE: &str = "kvlease.v1";

/// Nested messages read at most this deep; deeper ones pass unread. prost
/// refuses anything nested past its limit of 100, so every message it
/// decodes is read whole.
const MAX_DEPTH: u32 = 128;

/// What the check needs of the protocol: per message type, its 32-bit
/// fields and its message fields, by field number.
#[derive(Debug, Default)]
struct Schema {
    messages: Vec<MessageType>,
    /// Indices into `messages` by name.
    names: HashMap<String, usize>,
}

#[derive(Debug)]
struct MessageType {
    /// The name within the package: `GenerateRequest`, `Outer.Inner`.
    name: String,
    /// Indexed by field number; `None` for the fields the check skips.
    fields: Vec<Option<Field>>,
}

#[derive(Debug)]
struct Field {
    name: String,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `uint32`, and `sint32` (zigzag over 32 bits).
    Unsigned,
    /// `int32` and enums: negative numbers are sign-extended to 64 bits.
    Signed,
    /// A message field: an index into [`Schema::messages`].
    Message(usize),
}

static SCHEMA: LazyLock<Schema> = LazyLock::new(|| {
    // The set is this crate's own build output; a test decodes it, so a
    // failure here would be a build fault, and the check then reads nothing.
    FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
        .map(|set| Schema::new(&set))
        .unwrap_or_default()
});

impl Schema {
    fn new(set: &FileDescriptorSet) -> Self {
        // every message type of the package, nested ones too, by the name
        // fields refer to it with (".kvlease.v1.Outer.Inner")
        let mut types: Vec<(String, &DescriptorProto)> = Vec::new();
        fn collect<'a>(
            prefix: &str,
            messages: &'a [DescriptorProto],
            out: &mut Vec<(String, &'a DescriptorProto)>,
        ) {
            for m in messages {
                let name = format!("{prefix}.{}", m.name());
                collect(&name, &m.nested_type, out);
                out.push((name, m));
            }
        }
        for file in set.file.iter().filter(|f| f.package() == PACKAGE) {
            collect(&format!(".{PACKAGE}"), &file.message_type, &mut types);
        }
        let index = |type_name: &str| types.iter().position(|(n, _)| n == type_name);
        let messages = types
            .iter()
            .map(|(full, m)| {
                let mut fields: Vec<Option<Field>> = Vec::new();
                for f in &m.field {
                    let kind = match f.r#type() {
                        Type::Uint32 | Type::Sint32 => Kind::Unsigned,
                        Type::Int32 | Type::Enum => Kind::Signed,
                        Type::Message => match index(f.type_name()) {
                            Some(i) => Kind::Message(i),
                            None => continue,
                        },
                        _ => continue,
                    };
                    let Ok(number) = usize::try_from(f.number()) else {
                        continue;
                    };
                    if fields.len() <= number {
                        fields.resize_with(number + 1, || None);
                    }
                    fields[number] = Some(Field {
                        name: f.name().to_owned(),
                        kind,
                    });
                }
                let name = full
                    .strip_prefix(&format!(".{PACKAGE}."))
                    .unwrap_or(full)
                    .to_owned();
                MessageType { name, fields }
            })
            .collect::<Vec<_>>();
        let names = messages
            .iter()
            .enumerate()
            .map(|(i, m)| (m.name.clone(), i))
            .collect();
        Self { messages, names }
    }

    fn by_name(&self, name: &str) -> Option<usize> {
        self.names.get(name).copied()
    }

    /// Checks the fields of one message of type `message` in `wire`.
    fn check(&self, message: usize, mut wire: &[u8], depth: u32) -> Result<(), OutOfRange> {
        if depth > MAX_DEPTH {
            return Ok(());
        }
        let fields = &self.messages[message].fields;
        while !wire.is_empty() {
            let Some(key) = varint(&mut wire) else {
                return Ok(());
            };
            let number = key >> 3;
            let field = usize::try_from(number)
                .ok()
                .and_then(|n| fields.get(n))
                .and_then(Option::as_ref);
            match key & 7 {
                VARINT => {
                    let Some(value) = varint(&mut wire) else {
                        return Ok(());
                    };
                    if let Some(f) = field {
                        f.fits(value)?;
                    }
                }
                LEN => {
                    let Some(body) = varint(&mut wire).and_then(|len| take(&mut wire, len)) else {
                        return Ok(());
                    };
                    let Some(f) = field else {
                        continue;
                    };
                    match f.kind {
                        Kind::Message(inner) => self
                            .check(inner, body, depth + 1)
                            .map_err(|e| e.inside(&f.name))?,
                        // a packed run of 32-bit numbers
                        Kind::Unsigned | Kind::Signed => {
                            let mut packed = body;
                            while let Some(value) = varint(&mut packed) {
                                f.fits(value)?;
                            }
                        }
                    }
                }
                FIXED64 if take(&mut wire, 8).is_some() => {}
                FIXED32 if take(&mut wire, 4).is_some() => {}
                // proto3 has no groups, but prost skips them as unknown
                // fields: so must the check, to read what follows
                START_GROUP if skip_group(&mut wire, number, depth) => {}
                // a truncated field, an end of group out of place or no wire
                // type at all: prost refuses the message
                _ => return Ok(()),
            }
        }
        Ok(())
    }
}

impl Field {
    /// Whether `value` from the wire fits this field's type.
    fn fits(&self, value: u64) -> Result<(), OutOfRange> {
        let fault = match self.kind {
            Kind::Unsigned if u32::try_from(value).is_err() => Value::Unsigned(value),
            // the wire holds the two's complement of the 64-bit number
            Kind::Signed if i32::try_from(value as i64).is_err() => Value::Signed(value as i64),
            _ => return Ok(()),
        };
        Err(OutOfRange {
            field: self.name.clone(),
            value: fault,
        })
    }
}

// === wire format ===

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const START_GROUP: u64 = 3;
const END_GROUP: u64 = 4;
const FIXED32: u64 = 5;

/// Reads one varint as prost does: at most ten bytes, the tenth 0 or 1.
fn varint(wire: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = wire.split_first()?;
        *wire = rest;
        if i == 9 && byte > 1 {
            return None;
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// Takes the next `len` bytes.
fn take<'a>(wire: &mut &'a [u8], len: u64) -> Option<&'a [u8]> {
    let len = usize::try_from(len).ok()?;
    if len > wire.len() {
        return None;
    }
    let (body, rest) = wire.split_at(len);
    *wire = rest;
    Some(body)
}

/// Skips a group begun with field `number`, up to its end; false when it
/// does not end well.
fn skip_group(wire: &mut &[u8], number: u64, depth: u32) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    loop {
        let Some(key) = varint(wire) else {
            return false;
        };
        let skipped = match key & 7 {
            VARINT => varint(wire).is_some(),
            FIXED64 => take(wire, 8).is_some(),
            LEN => varint(wire).and_then(|len| take(wire, len)).is_some(),
            START_GROUP => skip_group(wire, key >> 3, depth + 1),
            END_GROUP => return key >> 3 == number,
            FIXED32 => take(wire, 4).is_some(),
            _ => false,
        };
        if !skipped {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1 as pb;

    /// `GenerateRequest`'s numbers, as a client could send them: 64 bits wide.
    #[derive(Clone, PartialEq, prost::Message)]
    struct WideGenerate {
        #[prost(uint64, repeated, tag = "2")]
        tokens: Vec<u64>,
        #[prost(uint64, tag = "3")]
        max_tokens: u64,
        #[prost(uint64, repeated, packed = "false", tag = "7")]
        stop_tokens: Vec<u64>,
    }

    /// `LeaseRequest` with one wide `SequenceSpec`.
    #[derive(Clone, PartialEq, prost::Message)]
    struct WideLease {
        #[prost(message, repeated, tag = "5")]
        sequences: Vec<WideSpec>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct WideSpec {
        #[prost(uint64, tag = "7")]
        max_new_tokens: u64,
    }

    /// `GenerateResponse.finish_reason` (an enum: int32 on the wire), 64 bits wide.
    #[derive(Clone, PartialEq, prost::Message)]
    struct WideFinish {
        #[prost(int64, tag = "3")]
        finish_reason: i64,
    }

    const OVER: u64 = (1 << 32) + 5;

    #[test]
    fn the_descriptor_set_gives_the_fields_to_check() {
        let schema = &*SCHEMA;
        let field = |message: &str, name: &str| {
            let m = &schema.messages[schema.by_name(message).expect(message)];
            m.fields
                .iter()
                .flatten()
                .find(|f| f.name == name)
                .map(|f| f.kind)
        };
        assert_eq!(field("GenerateRequest", "max_tokens"), Some(Kind::Unsigned));
        assert_eq!(field("GenerateRequest", "tokens"), Some(Kind::Unsigned));
        assert_eq!(
            field("GenerateRequest", "seed"),
            None,
            "64 bits: nothing to check"
        );
        assert_eq!(field("GenerateRequest", "text"), None);
        assert_eq!(
            field("GenerateResponse", "finish_reason"),
            Some(Kind::Signed)
        );
        assert_eq!(
            field("LeaseRequest", "sequences"),
            schema.by_name("SequenceSpec").map(Kind::Message)
        );
        assert_eq!(
            field("ForwardRequest", "sequences"),
            schema.by_name("ForwardSequence").map(Kind::Message)
        );
    }

    #[test]
    fn a_32_bit_field_over_its_range_is_refused_naming_it() {
        let wide = WideGenerate {
            max_tokens: OVER,
            ..Default::default()
        }
        .encode_to_vec();
        // what prost alone makes of it
        let read = pb::GenerateRequest::decode(wide.as_slice()).unwrap();
        assert_eq!(read.max_tokens, 5, "prost truncates");
        let e = check::<pb::GenerateRequest>(&wide).unwrap_err();
        assert_eq!(
            e.to_string(),
            "GenerateRequest.max_tokens is 4294967301, over its 32-bit limit of 4294967295"
        );
        let fits = WideGenerate {
            max_tokens: u64::from(u32::MAX),
            ..Default::default()
        };
        assert_eq!(check::<pb::GenerateRequest>(&fits.encode_to_vec()), Ok(()));
    }

    #[test]
    fn repeated_fields_are_checked_packed_and_unpacked() {
        for wide in [
            WideGenerate {
                tokens: vec![1, 2, 1 << 32],
                ..Default::default()
            },
            WideGenerate {
                stop_tokens: vec![1, 1 << 32],
                ..Default::default()
            },
        ] {
            let e = check::<pb::GenerateRequest>(&wide.encode_to_vec()).unwrap_err();
            assert!(
                e.to_string()
                    .contains("is 4294967296, over its 32-bit limit"),
                "{e}"
            );
            assert!(
                e.field == "GenerateRequest.tokens" || e.field == "GenerateRequest.stop_tokens",
                "{e}"
            );
        }
    }

    #[test]
    fn fields_of_nested_messages_are_named_by_their_path() {
        let wide = WideLease {
            sequences: vec![
                WideSpec { max_new_tokens: 8 },
                WideSpec {
                    max_new_tokens: OVER,
                },
            ],
        };
        let e = check::<pb::LeaseRequest>(&wide.encode_to_vec()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "LeaseRequest.sequences.max_new_tokens is 4294967301, over its 32-bit limit of 4294967295"
        );
    }

    #[test]
    fn signed_fields_take_negative_numbers_and_refuse_wider_ones() {
        let wire = |v: i64| WideFinish { finish_reason: v }.encode_to_vec();
        for fits in [-1, i64::from(i32::MIN), i64::from(i32::MAX), 3] {
            assert_eq!(check::<pb::GenerateResponse>(&wire(fits)), Ok(()), "{fits}");
        }
        for over in [i64::from(i32::MIN) - 1, 1 << 31, i64::MAX] {
            let e = check::<pb::GenerateResponse>(&wire(over)).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "GenerateResponse.finish_reason is {over}, outside its 32-bit range -2147483648 to 2147483647"
                )
            );
        }
    }

    /// The key of field `number` with `wire_type`.
    fn key(number: u64, wire_type: u64) -> Vec<u8> {
        let mut key = Vec::new();
        prost::encoding::encode_varint(number << 3 | wire_type, &mut key);
        key
    }

    #[test]
    fn unknown_fields_and_groups_before_a_field_do_not_hide_it() {
        let mut wire = Vec::new();
        // unknown fields: length-delimited, fixed32, fixed64
        wire.extend(key(99, LEN));
        wire.extend([3, 0xff, 0xff, 0xff]);
        wire.extend(key(98, FIXED32));
        wire.extend([0; 4]);
        wire.extend(key(97, FIXED64));
        wire.extend([0; 8]);
        // a group holding a field 3 that would not fit, and a nested group
        wire.extend(key(96, START_GROUP));
        wire.extend(key(3, VARINT));
        wire.extend([0xff, 0xff, 0xff, 0xff, 0x7f]);
        wire.extend(key(95, START_GROUP));
        wire.extend(key(95, END_GROUP));
        wire.extend(key(96, END_GROUP));
        wire.extend(
            WideGenerate {
                max_tokens: OVER,
                ..Default::default()
            }
            .encode_to_vec(),
        );
        assert_eq!(
            pb::GenerateRequest::decode(wire.as_slice())
                .unwrap()
                .max_tokens,
            5,
            "prost skips all of it and truncates"
        );
        let e = check::<pb::GenerateRequest>(&wire).unwrap_err();
        assert_eq!(e.field, "GenerateRequest.max_tokens");
    }

    #[test]
    fn what_prost_refuses_passes_the_check() {
        let malformed: [Vec<u8>; 4] = [
            // a field without its value
            key(3, VARINT),
            // a length past the end
            [key(2, LEN), vec![5, 1]].concat(),
            // a group that never ends
            [key(15, START_GROUP), key(3, VARINT), vec![1]].concat(),
            // a varint of eleven bytes
            vec![0xff; 11],
        ];
        for wire in malformed {
            assert_eq!(check::<pb::GenerateRequest>(&wire), Ok(()), "{wire:?}");
            assert!(
                pb::GenerateRequest::decode(wire.as_slice()).is_err(),
                "{wire:?}"
            );
        }
    }
}
