//! GGUF vocabularies that cannot be used say why; fingerprints tell
//! tokenizers apart.

use kvlease_tokenizer::{Error, GgufVocab, Tokenizer, TokenizerKind};

fn gpt2(tokens: &[&str]) -> GgufVocab {
    GgufVocab {
        model: "gpt2".into(),
        pre: Some("default".into()),
        tokens: tokens.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn message(v: &GgufVocab) -> String {
    match Tokenizer::from_gguf(v) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unusable_vocabularies_are_named() {
    assert!(message(&gpt2(&[])).contains("tokenizer.ggml.tokens is empty"));
    let mut v = gpt2(&["a", "b"]);
    v.model = "bert".into();
    assert!(message(&v).contains("tokenizer.ggml.model \"bert\" is not supported"));
    let mut v = gpt2(&["a", "b"]);
    v.pre = Some("mystery".into());
    assert!(message(&v).contains("tokenizer.ggml.pre \"mystery\" is not supported"));
    let mut v = gpt2(&["a", "b"]);
    v.eos_id = Some(7);
    assert!(
        message(&v).contains("tokenizer.ggml.eos_token_id 7 is outside the vocabulary of 2 tokens")
    );
    let mut v = gpt2(&["a", "b"]);
    v.token_types = vec![1];
    assert!(message(&v).contains("tokenizer.ggml.token_type has 1 entries for 2 tokens"));
    let mut v = gpt2(&["a", "b", "ab"]);
    v.merges = vec!["ab".into()];
    assert!(message(&v).contains("tokenizer.ggml.merges[0] \"ab\" is not two tokens"));
}

#[test]
fn merges_apply_and_fingerprints_differ_with_the_parts() {
    let mut v = gpt2(&["a", "b", "ab"]);
    v.merges = vec!["a b".into()];
    let t = Tokenizer::from_gguf(&v).unwrap();
    assert_eq!(t.encode("abab").unwrap(), vec![2, 2]);
    assert_eq!(t.decode(&[2, 0]), "aba");
    assert_eq!(t.parts().kind, TokenizerKind::HuggingFace);
    assert_eq!(t.fingerprint().len(), 16);
    let same = Tokenizer::from_gguf(&v).unwrap();
    assert_eq!(same.fingerprint(), t.fingerprint());
    let mut other = v.clone();
    other.chat_template = Some("{{ messages }}".into());
    assert_ne!(
        Tokenizer::from_gguf(&other).unwrap().fingerprint(),
        t.fingerprint()
    );
    assert_ne!(Tokenizer::byte_level().fingerprint(), t.fingerprint());
}

#[test]
fn sentencepiece_without_merges_uses_the_scores() {
    // "▁ab" is best, then "ab": "▁ab" must come out whole
    let v = GgufVocab {
        model: "llama".into(),
        tokens: [
            "<unk>",
            "<s>",
            "</s>",
            "\u{2581}",
            "a",
            "b",
            "ab",
            "\u{2581}a",
            "\u{2581}ab",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        token_types: vec![2, 3, 3, 1, 1, 1, 1, 1, 1],
        scores: vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -0.5],
        bos_id: Some(1),
        eos_id: Some(2),
        unknown_id: Some(0),
        ..Default::default()
    };
    let t = Tokenizer::from_gguf(&v).unwrap();
    assert_eq!(t.encode("ab").unwrap(), vec![1, 8]);
    assert_eq!(t.decode(&[1, 8, 8]), "ab ab");
    assert_eq!(t.end_ids(), &[2]);
    // a SentencePiece piece's bytes: `▁` is a space; specials their text
    assert_eq!(t.token_bytes(8), b" ab");
    assert_eq!(t.token_bytes(6), b"ab");
    assert_eq!(t.token_bytes(1), b"<s>");
}

#[test]
fn parts_with_bad_ids_or_json_are_refused() {
    let mut parts = Tokenizer::byte_level().parts().clone();
    parts.specials.end_ids.push(300);
    assert!(matches!(Tokenizer::from_parts(parts), Err(Error::Invalid(m)) if m.contains("300")));
    let mut parts = Tokenizer::byte_level().parts().clone();
    parts.kind = TokenizerKind::HuggingFace;
    parts.tokenizer_json = "{".into();
    assert!(
        matches!(Tokenizer::from_parts(parts), Err(Error::Invalid(m)) if m.contains("tokenizer.json"))
    );
}
