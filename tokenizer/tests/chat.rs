//! Chat templates the way transformers renders them: trimmed blocks, loop
//! variables, `raise_exception`, Python string methods, BOS/EOS text.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use kvlease_tokenizer::{Error, GgufVocab, Message, Tokenizer};

fn with_template(template: &str) -> Tokenizer {
    let tokens: Vec<String> = ["<s>", "</s>", "a", "b", "Ġ"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let vocab = GgufVocab {
        model: "gpt2".into(),
        tokens,
        token_types: vec![3, 3, 1, 1, 1],
        bos_id: Some(0),
        eos_id: Some(1),
        chat_template: Some(template.into()),
        ..Default::default()
    };
    Tokenizer::from_gguf(&vocab).expect("builds")
}

#[test]
fn loop_vars_trim_blocks_and_generation_prompt() {
    let t = with_template(
        "{{ bos_token }}{% for m in messages %}\n{% if loop.first %}[first]{% endif %}{{ m['role'] | upper }}: {{ m.content.strip() }}{% if not loop.last %}|{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}ASSISTANT:{% endif %}",
    );
    let text = t
        .render_chat(&[
            Message::new("user", "  hi "),
            Message::new("assistant", "yo"),
        ])
        .unwrap();
    assert_eq!(text, "<s>[first]USER: hi|ASSISTANT: yoASSISTANT:");
}

#[test]
fn raise_exception_is_the_error_message() {
    let t = with_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}{{ eos_token }}",
    );
    assert_eq!(t.render_chat(&[Message::new("user", "x")]).unwrap(), "</s>");
    let e = t.render_chat(&[Message::new("system", "x")]).unwrap_err();
    assert!(
        matches!(&e, Error::Template(m) if m == "Conversation must start with user"),
        "{e}"
    );
}

#[test]
fn a_template_that_does_not_parse_fails_at_load() {
    let vocab = GgufVocab {
        model: "gpt2".into(),
        tokens: vec!["a".into()],
        chat_template: Some("{% for m in messages %}".into()),
        ..Default::default()
    };
    assert!(matches!(
        Tokenizer::from_gguf(&vocab),
        Err(Error::Template(_))
    ));
}

#[test]
fn no_template_is_its_own_error() {
    let t = Tokenizer::byte_level();
    assert!(!t.has_chat_template());
    assert!(matches!(
        t.render_chat(&[Message::new("user", "x")]),
        Err(Error::NoChatTemplate)
    ));
}

#[test]
fn rendered_specials_encode_whole() {
    let t = with_template(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    );
    // "ab" has no merges: two tokens; <s> and </s> are matched whole
    assert_eq!(
        t.encode_chat(&[Message::new("user", "ab")]).unwrap(),
        vec![0, 2, 3, 1]
    );
}
