//! Streaming decode equals one-shot decode (property tests over random id
//! sequences, which split characters anywhere), for the byte-level
//! tokenizer and a SentencePiece-style vocabulary with byte fallback; stop
//! strings across pushes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use kvlease_tokenizer::{GgufVocab, StopStrings, Tokenizer, gguf::token_type};
use proptest::prelude::*;

/// A small SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
/// and a few pieces with the word-start mark.
fn sentencepiece() -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(token_type::BYTE);
    }
    for piece in [
        "\u{2581}",
        "a",
        "b",
        "\u{2581}a",
        "\u{2581}b",
        "ab",
        "\u{2581}ab",
        "é",
        "\u{2581}é",
    ] {
        tokens.push(piece.to_string());
        types.push(token_type::NORMAL);
    }
    let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
    let vocab = GgufVocab {
        model: "llama".into(),
        tokens,
        token_types: types,
        scores,
        bos_id: Some(1),
        eos_id: Some(2),
        unknown_id: Some(0),
        ..Default::default()
    };
    Tokenizer::from_gguf(&vocab).expect("builds")
}

fn streamed(tok: &Tokenizer, ids: &[u32], chunks: &[usize]) -> String {
    let mut stream = tok.stream();
    let mut text = String::new();
    let mut at = 0;
    for &n in chunks {
        let end = (at + n).min(ids.len());
        text.push_str(&stream.push(&ids[at..end]));
        at = end;
    }
    text.push_str(&stream.push(&ids[at..]));
    text.push_str(&stream.finish());
    text
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn byte_level_stream_equals_one_shot(
        ids in prop::collection::vec(0u32..258, 0..40),
        chunks in prop::collection::vec(0usize..4, 0..20),
    ) {
        let tok = Tokenizer::byte_level();
        prop_assert_eq!(streamed(&tok, &ids, &chunks), tok.decode(&ids));
    }

    #[test]
    fn sentencepiece_stream_equals_one_shot(
        ids in prop::collection::vec(0u32..268, 0..40),
        chunks in prop::collection::vec(0usize..4, 0..20),
    ) {
        let tok = sentencepiece();
        prop_assert_eq!(streamed(&tok, &ids, &chunks), tok.decode(&ids));
    }

    // (a leading space is lost, as in the reference: "▁" starts the text)
    #[test]
    fn text_round_trips_through_sentencepiece(text in "[abé\u{4e16}\u{1F600}][ab é\u{4e16}\u{1F600}]{0,20}") {
        let tok = sentencepiece();
        let ids = tok.encode_with(&text, false).unwrap();
        prop_assert_eq!(tok.decode(&ids), text.clone());
        prop_assert_eq!(streamed(&tok, &ids, &[1; 64]), text);
    }

    #[test]
    fn stop_strings_cut_at_the_first_stop_wherever_the_text_splits(
        text in "[abc\n]{0,30}",
        cuts in prop::collection::vec(0usize..5, 0..12),
    ) {
        let stops = ["bc", "\n\n", "cab"];
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        let mut at = 0;
        for n in cuts {
            let end = (at + n).min(text.len());
            out.push_str(&s.push(&text[at..end]));
            at = end;
        }
        out.push_str(&s.push(&text[at..]));
        out.push_str(&s.finish());
        let first = stops.iter().filter_map(|st| text.find(st)).min();
        prop_assert_eq!(s.stopped(), first.is_some());
        prop_assert_eq!(out, text[..first.unwrap_or(text.len())].to_string());
    }
}

#[test]
fn split_characters_are_held_until_complete() {
    let tok = Tokenizer::byte_level();
    let bytes: Vec<u32> = "aé€".bytes().map(u32::from).collect();
    let mut d = tok.stream();
    assert_eq!(d.push(&bytes[..2]), "a");
    assert_eq!(d.push(&bytes[2..4]), "é");
    assert_eq!(d.push(&bytes[4..5]), "");
    assert_eq!(d.push(&bytes[5..]), "€");
    assert_eq!(d.push(&[0xE2, 256]), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

#[test]
fn sentencepiece_keeps_leading_spaces_inside_the_text() {
    let tok = sentencepiece();
    let ids = tok.encode("ab a").unwrap();
    assert_eq!(ids[0], 1, "llama vocabularies add BOS by default");
    let mut d = tok.stream();
    let parts: Vec<String> = ids.iter().map(|&id| d.push(&[id])).collect();
    assert_eq!(parts.concat() + &d.finish(), "ab a");
    // the word-start mark of the first word is not a space in the text
    assert!(!parts.concat().starts_with(' '));
}
