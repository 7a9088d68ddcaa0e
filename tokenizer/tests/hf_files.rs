//! A tokenizer written out as a Hugging Face tokenizer directory
//! (`Tokenizer::hf_files`, what `kvlease model tokenizer` writes for load
//! generators) reads back as the same tokenizer.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod common;

use kvlease_tokenizer::{Message, Tokenizer};

#[test]
fn the_byte_level_tokenizer_has_no_hf_files() {
    let e = Tokenizer::byte_level().hf_files().unwrap_err();
    assert!(e.to_string().contains("no tokenizer.json"), "{e}");
}

/// SmolLM2's tokenizer, built from its GGUF metadata, written as files and
/// read back with `from_hf_dir`: the same fingerprint (tokenizer, chat
/// template, special tokens and end ids), so the same encodings and chats.
#[test]
fn smollm2_hf_files_read_back_as_the_same_tokenizer() {
    let Some(path) = common::smollm2_gguf() else {
        return;
    };
    let gguf = Tokenizer::from_gguf(&common::read_vocab(&path)).unwrap();
    let dir = common::temp_dir("hf-files");
    let files = gguf.hf_files().unwrap();
    let names: Vec<&str> = files.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        names,
        [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json"
        ]
    );
    for (name, contents) in &files {
        std::fs::write(dir.join(name), contents).unwrap();
    }
    let back = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(back.specials(), gguf.specials());
    assert_eq!(back.fingerprint(), gguf.fingerprint());
    let text = "The capital of France is 1234, isn't it?";
    assert_eq!(back.encode(text).unwrap(), gguf.encode(text).unwrap());
    let chat = [Message::new("user", "hi")];
    assert_eq!(
        back.render_chat(&chat).unwrap(),
        gguf.render_chat(&chat).unwrap()
    );
    let config: serde_json::Value =
        serde_json::from_str(&files[1].1).expect("tokenizer_config.json is JSON");
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    std::fs::remove_dir_all(&dir).unwrap();
}
