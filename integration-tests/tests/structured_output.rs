//! Structured output over real gRPC (cache, CPU worker, scheduler on
//! loopback ports) with the seeded model, whose random weights would never
//! write JSON on their own: under `Generate.grammar` every output of 20
//! prompts, greedy and sampled, ends STOP and parses (`json_object`) or
//! validates against its schema (`json_schema`), a regex and a Lark grammar
//! are followed, in the plain and the pipelined order (where the worker
//! takes the fed token on the host for the matcher); unconstrained requests
//! running beside constrained ones give what they give alone; bad grammars
//! are INVALID_ARGUMENT naming the field; the pools are whole and the audit
//! clean afterwards.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, assert_cache_sound, collect, invalid_field, scheduler_client,
    small_worker_with, start_cache, start_scheduler, start_worker,
};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::grammar::Kind;
use serde_json::Value;

const WITHIN: Duration = Duration::from_secs(60);

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"},
    "tag": {"enum": ["red", "green", "blue"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
  },
  "required": ["name", "age", "ok", "tag", "scores"],
  "additionalProperties": false
}"#;

/// Whether `v` satisfies [`SCHEMA`], checked by hand (an independent
/// reading of the schema, not the engine's).
fn satisfies_schema(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if keys != ["age", "name", "ok", "scores", "tag"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is no string")?;
    if name.chars().count() > 8 {
        return Err(format!("name {name:?} is over 8 characters"));
    }
    let age = o["age"].as_i64().ok_or("age is no integer")?;
    if !(0..=120).contains(&age) {
        return Err(format!("age {age}"));
    }
    o["ok"].as_bool().ok_or("ok is no boolean")?;
    let tag = o["tag"].as_str().ok_or("tag is no string")?;
    if !["red", "green", "blue"].contains(&tag) {
        return Err(format!("tag {tag:?}"));
    }
    let scores = o["scores"].as_array().ok_or("scores is no array")?;
    if scores.len() > 3
        || !scores
            .iter()
            .all(|s| s.as_i64().is_some_and(|n| (0..=9).contains(&n)))
    {
        return Err(format!("scores {scores:?}"));
    }
    Ok(())
}

/// Whether `text` is one JSON value (RFC 8259) and nothing else: a syntax
/// check of its own, since serde_json refuses numbers past f64's range
/// (`7e7023177`) that JSON allows.
fn is_json(text: &str) -> bool {
    fn ws(b: &[u8], mut i: usize) -> usize {
        while i < b.len() && b" \t\n\r".contains(&b[i]) {
            i += 1;
        }
        i
    }
    fn digits(b: &[u8], mut i: usize) -> Option<usize> {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        (i > start).then_some(i)
    }
    fn string(b: &[u8], mut i: usize) -> Option<usize> {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        i += 1;
        loop {
            match *b.get(i)? {
                b'"' => return Some(i + 1),
                b'\\' => match *b.get(i + 1)? {
                    b'u' => {
                        let hex = b.get(i + 2..i + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        i += 6;
                    }
                    c if b"\"\\/bfnrt".contains(&c) => i += 2,
                    _ => return None,
                },
                c if c < 0x20 => return None,
                _ => i += 1,
            }
        }
    }
    fn value(b: &[u8], i: usize) -> Option<usize> {
        let i = ws(b, i);
        let end = match *b.get(i)? {
            b'{' => {
                let mut j = ws(b, i + 1);
                if b.get(j) == Some(&b'}') {
                    return Some(j + 1);
                }
                loop {
                    j = ws(b, string(b, ws(b, j))?);
                    if b.get(j) != Some(&b':') {
                        return None;
                    }
                    j = ws(b, value(b, j + 1)?);
                    match b.get(j)? {
                        b',' => j += 1,
                        b'}' => break j + 1,
                        _ => return None,
                    }
                }
            }
            b'[' => {
                let mut j = ws(b, i + 1);
                if b.get(j) == Some(&b']') {
                    return Some(j + 1);
                }
                loop {
                    j = ws(b, value(b, j)?);
                    match b.get(j)? {
                        b',' => j += 1,
                        b']' => break j + 1,
                        _ => return None,
                    }
                }
            }
            b'"' => string(b, i)?,
            b't' if b[i..].starts_with(b"true") => i + 4,
            b'f' if b[i..].starts_with(b"false") => i + 5,
            b'n' if b[i..].starts_with(b"null") => i + 4,
            _ => {
                let mut j = i + usize::from(b[i] == b'-');
                j = if b.get(j) == Some(&b'0') {
                    j + 1
                } else {
                    digits(b, j)?
                };
                if b.get(j) == Some(&b'.') {
                    j = digits(b, j + 1)?;
                }
                if matches!(b.get(j), Some(b'e' | b'E')) {
                    j += 1;
                    if matches!(b.get(j), Some(b'+' | b'-')) {
                        j += 1;
                    }
                    j = digits(b, j)?;
                }
                j
            }
        };
        Some(ws(b, end))
    }
    let b = text.as_bytes();
    value(b, 0) == Some(b.len())
}

#[test]
fn the_json_check_accepts_json_and_nothing_else() {
    for ok in [
        r#"{"a":[1,-2.5e3,true,null,"x\u00e9\n"],"b":{}}"#,
        "7e7023177",
        r#" "s" "#,
    ] {
        assert!(is_json(ok), "{ok}");
    }
    for bad in [
        r#"{"a":}"#,
        "{",
        "01",
        r#"{"a":1,}"#,
        "[1 2]",
        r#""\x""#,
        "tru",
        "{} {}",
    ] {
        assert!(!is_json(bad), "{bad}");
    }
}

fn grammar(kind: Kind) -> Option<pb::Grammar> {
    Some(pb::Grammar { kind: Some(kind) })
}

/// A generation that must end STOP under its grammar: its text.
fn stopped(g: Generated) -> String {
    assert_eq!(
        g.finish_reason(),
        pb::FinishReason::Stop,
        "{}: {:?}",
        g.message,
        g.text
    );
    assert_eq!(g.tokens.last(), Some(&257), "ends on the end token");
    g.text
}

async fn structured(overlap: bool) {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    // room for all 20 constrained requests at once
    let worker = start_worker(small_worker_with(16, 512)).await.unwrap();
    let config = scheduler_svc::Config {
        max_context: 320,
        max_tokens: 256,
        overlap,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[worker.url()], WITHIN)
        .await
        .unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let prompt = |i: u32| format!("Request {i}: describe a person as JSON, please.");
    let plain = |i: u32| pb::GenerateRequest {
        text: prompt(i),
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    // unconstrained outputs alone, to compare with outputs beside
    // constrained requests
    let mut alone = Vec::new();
    for i in 0..3 {
        alone.push(collect(&mut client, plain(i)).await.unwrap().tokens);
    }

    let mut tasks = Vec::new();
    for i in 0..20u32 {
        let mut c = client.clone();
        let sampled = i % 2 == 1;
        let schema = pb::GenerateRequest {
            text: prompt(i),
            max_tokens: 240,
            temperature: if sampled { 0.9 } else { 0.0 },
            seed: u64::from(i),
            grammar: grammar(Kind::JsonSchema(SCHEMA.into())),
            ..Default::default()
        };
        let object = pb::GenerateRequest {
            grammar: grammar(Kind::JsonObject(true)),
            ..schema.clone()
        };
        tasks.push(tokio::spawn(async move {
            let s = stopped(collect(&mut c, schema).await.unwrap());
            let o = stopped(collect(&mut c, object).await.unwrap());
            (s, o)
        }));
    }
    // unconstrained requests in the same batches
    let mut beside = Vec::new();
    for i in 0..3 {
        let mut c = client.clone();
        let r = plain(i);
        beside.push(tokio::spawn(async move {
            collect(&mut c, r).await.unwrap().tokens
        }));
    }
    for t in tasks {
        let (schema_text, object_text) = t.await.unwrap();
        let v: Value = serde_json::from_str(&schema_text)
            .unwrap_or_else(|e| panic!("{schema_text:?} does not parse: {e}"));
        if let Err(why) = satisfies_schema(&v) {
            panic!("{schema_text} breaks the schema: {why}");
        }
        assert!(
            is_json(&object_text) && object_text.starts_with('{'),
            "{object_text:?} is no JSON object"
        );
    }
    for (i, t) in beside.into_iter().enumerate() {
        assert_eq!(
            t.await.unwrap(),
            alone[i],
            "an unconstrained request beside constrained ones"
        );
    }

    let regex = pb::GenerateRequest {
        text: prompt(0),
        max_tokens: 30,
        grammar: grammar(Kind::Regex("(yes|no), [0-9]{2,4}!".into())),
        ..Default::default()
    };
    let text = stopped(collect(&mut client, regex.clone()).await.unwrap());
    let (word, rest) = text.split_once(", ").expect("a comma");
    assert!(["yes", "no"].contains(&word), "{text:?}");
    let digits = rest.strip_suffix('!').expect("a bang");
    assert!(
        (2..=4).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()),
        "{text:?}"
    );
    let lark = pb::GenerateRequest {
        grammar: grammar(Kind::Lark(
            "start: greeting \" \" NAME\ngreeting: \"hi\" | \"hello\"\nNAME: /[a-z]{1,6}/".into(),
        )),
        ..regex.clone()
    };
    let text = stopped(collect(&mut client, lark).await.unwrap());
    let (greeting, name) = text.split_once(' ').expect("a space");
    assert!(["hi", "hello"].contains(&greeting), "{text:?}");
    assert!(
        (1..=6).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase()),
        "{text:?}"
    );
    // max_tokens before the grammar completes: LENGTH, as any request
    let short = pb::GenerateRequest {
        max_tokens: 2,
        ..regex.clone()
    };
    let g = collect(&mut client, short).await.unwrap();
    assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);

    let bad = [
        (
            Kind::JsonSchema(r#"{"type": "strnig"}"#.into()),
            "grammar.json_schema",
            "strnig",
        ),
        (
            Kind::JsonSchema("{\"type\": ".into()),
            "grammar.json_schema",
            "not JSON",
        ),
        (Kind::Regex("(ab".into()), "grammar.regex", "regex"),
        (Kind::Lark("start: foo".into()), "grammar.lark", "foo"),
    ];
    for (kind, field, needle) in bad {
        let r = pb::GenerateRequest {
            grammar: grammar(kind),
            ..regex.clone()
        };
        let status = collect(&mut client, r).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(invalid_field(&status), Some(field), "{status:?}");
        assert!(status.message().contains(needle), "{status:?}");
    }
    let status = collect(
        &mut client,
        pb::GenerateRequest {
            grammar: Some(pb::Grammar { kind: None }),
            ..regex.clone()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(invalid_field(&status), Some("grammar"), "{status:?}");

    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_outputs_parse_and_validate_over_grpc() {
    structured(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_outputs_parse_and_validate_in_the_pipelined_order() {
    structured(true).await;
}
