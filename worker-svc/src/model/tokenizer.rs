//! Byte-level tokenizer: token ids 0..=255 are the bytes themselves,
//! [`BOS`] = 256 and [`EOS`] = 257 are the two specials.

/// Beginning-of-sequence token id.
pub const BOS: u32 = 256;
/// End-of-sequence token id.
pub const EOS: u32 = 257;
/// Size of the byte-level vocabulary (256 bytes plus BOS and EOS).
pub const VOCAB_SIZE: u32 = 258;

/// Text to token ids: one token per UTF-8 byte, with BOS first when asked.
pub fn encode(text: &str, add_bos: bool) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(text.len() + usize::from(add_bos));
    if add_bos {
        tokens.push(BOS);
    }
    tokens.extend(text.bytes().map(u32::from));
    tokens
}

/// Token ids to text: byte tokens become bytes (invalid UTF-8 is replaced),
/// specials and ids past the byte range are dropped.
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .filter_map(|&t| u8::try_from(t).ok())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_utf8_and_drops_specials() {
        let tokens = encode("héllo", true);
        assert_eq!(tokens[0], BOS);
        assert_eq!(tokens.len(), 1 + "héllo".len());
        let mut with_eos = tokens.clone();
        with_eos.push(EOS);
        assert_eq!(decode(&with_eos), "héllo");
    }
}
