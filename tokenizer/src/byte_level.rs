//! The seeded model's byte-level tokenizer: token ids 0..=255 are the bytes
//! themselves, [`BOS`] = 256 and [`EOS`] = 257 are the two specials.

use crate::Specials;

/// Beginning-of-sequence token id.
pub const BOS: u32 = 256;
/// End-of-sequence token id.
pub const EOS: u32 = 257;
/// 256 bytes plus BOS and EOS.
pub const VOCAB_SIZE: u32 = 258;

/// BOS and EOS; text prompts go without BOS (as the seeded model always had).
pub(crate) fn specials() -> Specials {
    Specials::new(Some(BOS), None, None, vec![EOS], false)
}

/// One token per UTF-8 byte.
pub(crate) fn bytes(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.bytes().map(u32::from)
}

/// Text to token ids: one token per UTF-8 byte, with BOS first when asked.
pub fn encode(text: &str, add_bos: bool) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(text.len() + usize::from(add_bos));
    if add_bos {
        tokens.push(BOS);
    }
    tokens.extend(bytes(text));
    tokens
}

/// Byte tokens become bytes (invalid UTF-8 is replaced); specials and ids
/// past the byte range are dropped.
pub fn decode(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().filter_map(|&t| u8::try_from(t).ok()).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
