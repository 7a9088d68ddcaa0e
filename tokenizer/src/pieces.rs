//! The bytes of one token (what a logprobs answer shows of it): the piece
//! in the vocabulary, mapped back to the bytes it stands for.

use tokenizers::DecoderWrapper;

/// The bytes a vocabulary `piece` stands for, by how the tokenizer decodes:
/// a byte-level BPE (GPT-2's, Llama 3's, SmolLM2's) maps each character
/// back to its byte; otherwise a byte-fallback piece `<0xAB>` is that byte
/// and a SentencePiece `▁` is a space. `special` pieces are their own text.
pub(crate) fn piece_bytes(
    piece: &str,
    decoder: Option<&DecoderWrapper>,
    byte_token: bool,
    special: bool,
) -> Vec<u8> {
    if special {
        return piece.as_bytes().to_vec();
    }
    if byte_token
        && let Some(b) = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok())
    {
        return vec![b];
    }
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => {
            let mapped: Option<Vec<u8>> = piece.chars().map(gpt2_byte).collect();
            // a piece outside the byte alphabet (an added token): its text
            mapped.unwrap_or_else(|| piece.as_bytes().to_vec())
        }
        _ => piece.replace('\u{2581}', " ").into_bytes(),
    }
}

/// The byte GPT-2's `bytes_to_unicode` maps to `c`: the printable bytes
/// (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) are themselves, the others, in order,
/// are U+0100 onwards.
fn gpt2_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    let n = c - 256;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_characters_map_back_to_their_bytes() {
        assert_eq!(gpt2_byte('a'), Some(b'a'));
        // space, newline and the bytes past 0x7f GPT-2 moved up
        assert_eq!(gpt2_byte('Ġ'), Some(b' '));
        assert_eq!(gpt2_byte('Ċ'), Some(b'\n'));
        assert_eq!(gpt2_byte('\u{0100}'), Some(0));
        assert_eq!(gpt2_byte('é'), Some(0xe9));
        assert_eq!(gpt2_byte('\u{4e00}'), None);
    }

    #[test]
    fn pieces_become_bytes_by_decoder() {
        let byte_level = DecoderWrapper::ByteLevel(Default::default());
        assert_eq!(
            piece_bytes("Ġhello", Some(&byte_level), false, false),
            b" hello"
        );
        // "é" split across two byte-level tokens: each holds one byte
        assert_eq!(piece_bytes("Ã", Some(&byte_level), false, false), [0xc3]);
        assert_eq!(piece_bytes("▁the", None, false, false), b" the");
        assert_eq!(piece_bytes("<0x0A>", None, true, false), b"\n");
        assert_eq!(
            piece_bytes("<|im_end|>", Some(&byte_level), false, true),
            b"<|im_end|>"
        );
    }
}
