//! SmolLM2's tokenizer built from its GGUF metadata (and from the
//! tokenizer.json that gives) against the Python `tokenizers` package:
//! `tests/fixtures/smollm2_encodings.json`, made by
//! `scripts/smollm2_reference.py` from the same GGUF.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod common;

use kvlease_tokenizer::{Message, Tokenizer};
use serde_json::Value;

fn fixture() -> Value {
    let text = include_str!("fixtures/smollm2_encodings.json");
    serde_json::from_str(text).expect("fixture is JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|i| i.as_u64().expect("id") as u32)
        .collect()
}

fn smollm2() -> Option<Tokenizer> {
    let path = common::smollm2_gguf()?;
    let vocab = common::read_vocab(&path);
    Some(Tokenizer::from_gguf(&vocab).expect("SmolLM2's tokenizer builds"))
}

/// Every fixture string encodes to the Python package's ids and decodes to
/// its text; returns how many were compared.
fn check_encodings(tok: &Tokenizer, fixture: &Value) -> usize {
    let cases = fixture["cases"].as_array().expect("cases");
    let mut wrong = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = ids(&case["ids"]);
        let got = tok.encode_with(text, false).expect("encode");
        if got != want {
            wrong.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        assert_eq!(
            tok.decode(&want),
            case["decoded"].as_str().expect("decoded"),
            "decoding the ids of {text:?}"
        );
    }
    assert!(
        wrong.is_empty(),
        "{} of {} strings encode differently:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    cases.len()
}

#[test]
fn gguf_tokenizer_encodes_as_the_python_package() {
    let Some(tok) = smollm2() else { return };
    let fixture = fixture();
    assert_eq!(
        u64::from(tok.vocab_size()),
        fixture["vocab_size"].as_u64().unwrap()
    );
    let n = check_encodings(&tok, &fixture);
    assert!(n >= 300, "only {n} strings in the fixture");
    println!("{n} strings encode and decode as the Python tokenizers package");
}

#[test]
fn gguf_specials_and_end_ids() {
    let Some(tok) = smollm2() else { return };
    let s = tok.specials();
    assert_eq!(s.bos_id, Some(1));
    assert_eq!(s.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(s.eos_token.as_deref(), Some("<|im_end|>"));
    assert!(!s.add_bos, "SmolLM2's GGUF says add_bos_token = false");
    // eos (<|im_end|>) and the control token <|endoftext|>, as llama.cpp
    assert_eq!(tok.end_ids(), &[0, 2]);
}

#[test]
fn chat_template_renders_as_transformers() {
    let Some(tok) = smollm2() else { return };
    let fixture = fixture();
    for chat in fixture["chats"].as_array().expect("chats") {
        let messages: Vec<Message> = chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        assert_eq!(
            tok.render_chat(&messages).unwrap(),
            chat["text"].as_str().unwrap()
        );
        assert_eq!(tok.encode_chat(&messages).unwrap(), ids(&chat["ids"]));
    }
}

#[test]
fn tokenizer_json_directory_gives_the_same_tokenizer() {
    let Some(tok) = smollm2() else { return };
    let dir = common::temp_dir("smollm2-hf");
    let parts = tok.parts();
    std::fs::write(dir.join("tokenizer.json"), &parts.tokenizer_json).unwrap();
    let config = serde_json::json!({
        "bos_token": parts.specials.bos_token,
        "eos_token": parts.specials.eos_token,
        "add_bos_token": false,
        "chat_template": parts.chat_template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 0]}"#,
    )
    .unwrap();
    let from_dir = Tokenizer::from_hf_dir(&dir).expect("loads");
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(from_dir.parts(), parts);
    assert_eq!(from_dir.fingerprint(), tok.fingerprint());
    let n = check_encodings(&from_dir, &fixture());
    println!("{n} strings encode as the Python package from tokenizer.json too");
}

#[test]
fn streaming_decode_of_real_outputs_equals_one_shot() {
    let Some(tok) = smollm2() else { return };
    let fixture = fixture();
    for case in fixture["cases"].as_array().unwrap() {
        let ids = ids(&case["ids"]);
        let mut stream = tok.stream();
        let mut text: String = ids.iter().map(|&id| stream.push(&[id])).collect();
        text.push_str(&stream.finish());
        assert_eq!(text, tok.decode(&ids), "{:?}", case["text"]);
    }
}

#[test]
fn parts_round_trip_to_the_same_tokenizer() {
    let Some(tok) = smollm2() else { return };
    let again = Tokenizer::from_parts(tok.parts().clone()).unwrap();
    assert_eq!(again.fingerprint(), tok.fingerprint());
    assert_eq!(again.parts(), tok.parts());
    assert_eq!(
        again.encode("The capital of France is").unwrap(),
        vec![504, 3575, 282, 4649, 314]
    );
}

/// A JSON schema over SmolLM2's 49k-token vocabulary: every token of a
/// valid output is allowed in turn, the end ids alone once it is complete;
/// prints what a mask and a consume cost per constrained row.
#[test]
fn json_schema_masks_over_the_real_vocabulary_and_their_cost() {
    use kvlease_tokenizer::grammar::{Constraint, allowed};
    let Some(t) = smollm2() else { return };
    let g = t
        .grammars()
        .expect("SmolLM2's vocabulary compiles grammars");
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}"#;
    let mut m = g
        .compile(&Constraint::JsonSchema(schema.into()))
        .expect("schema");
    let n = t.vocab_size() as usize;
    let target = t
        .encode_with(r#"{"name":"Ada","age":36}"#, false)
        .expect("encode");
    let mut words = Vec::new();
    let mut spent = std::time::Duration::ZERO;
    for &tok in &target {
        let started = std::time::Instant::now();
        m.mask_into(&mut words, n).expect("mask");
        spent += started.elapsed();
        assert!(
            allowed(&words, tok),
            "token {tok} of the valid output refused"
        );
        m.consume(tok).expect("consume");
    }
    m.mask_into(&mut words, n).expect("mask");
    let ends: Vec<u32> = (0..n as u32).filter(|&x| allowed(&words, x)).collect();
    assert_eq!(ends, t.end_ids(), "complete: the end ids only");
    println!(
        "mask per constrained row over {n} tokens: {:?} (mean of {})",
        spent / target.len() as u32,
        target.len()
    );
}

/// Each token's bytes ([`Tokenizer::token_bytes`], what logprobs answers
/// show), concatenated over an encoding, are the text's bytes: a character
/// split across byte-level tokens too.
#[test]
fn token_bytes_concatenate_to_the_text() {
    let Some(tok) = smollm2() else {
        return;
    };
    for text in [
        "The capital of France is Paris.",
        "  leading spaces\nand a newline",
        "caf\u{e9} \u{4e2d}\u{6587} \u{1f600}",
    ] {
        let ids = tok.encode_with(text, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&t| tok.token_bytes(t)).collect();
        assert_eq!(bytes, text.as_bytes(), "{text:?} as {ids:?}");
    }
    // special tokens are their own text
    assert!(
        tok.end_ids()
            .iter()
            .any(|&e| tok.token_bytes(e) == b"<|im_end|>"),
        "{:?}",
        tok.end_ids()
    );
    assert!(tok.token_bytes(u32::MAX).is_empty());
}
