//! Byte-level text: a prompt's UTF-8 bytes are its token ids, and generated
//! byte tokens are decoded incrementally (a character split across two
//! messages is held back until it is complete; token ids above 255 have no
//! text).

/// Token ids of a text prompt.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Incremental lossy UTF-8 decoding of byte tokens.
#[derive(Debug, Default)]
pub struct TextDecoder {
    pending: Vec<u8>,
}

impl TextDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Text for `tokens`, holding back an incomplete trailing character.
    pub fn push(&mut self, tokens: &[u32]) -> String {
        self.pending
            .extend(tokens.iter().filter_map(|&t| u8::try_from(t).ok()));
        let cut = incomplete_tail(&self.pending);
        let rest = self.pending.split_off(self.pending.len() - cut);
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        text
    }

    /// Whatever is held back, decoded lossily (end of stream).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Length of an incomplete UTF-8 sequence at the end of `bytes` (0 to 3).
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=3.min(bytes.len()) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: look further back
        }
        let need = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if need > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_are_held_until_complete() {
        let bytes = encode("aé€");
        let mut d = TextDecoder::new();
        assert_eq!(d.push(&bytes[..2]), "a");
        assert_eq!(d.push(&bytes[2..4]), "é");
        assert_eq!(d.push(&bytes[4..5]), "");
        assert_eq!(d.push(&bytes[5..]), "€");
        assert_eq!(d.push(&[0xE2, 256]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
