//! Log-probabilities in OpenAI's two shapes: the completions' legacy
//! object (`tokens`, `token_logprobs`, `top_logprobs` as a list of dicts,
//! `text_offset`) and chat's `content` list (`token`, `logprob`, `bytes`,
//! `top_logprobs`). The values are the scheduler's: of the model's raw
//! distribution, before logit_bias, penalties and temperature.

use serde_json::{Map, Value, json};

/// One token's log-probability as the scheduler sent it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLp {
    pub bytes: Vec<u8>,
    /// `None` for a prompt's first token.
    pub logprob: Option<f32>,
    /// (bytes, logprob) of the most likely tokens, the most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

/// A token as text: its bytes when they are UTF-8, else OpenAI's
/// `bytes:\xNN` form (a piece of a character split across tokens).
pub fn display(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let hex: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
            format!("bytes:{hex}")
        }
    }
}

/// Characters of the whole characters at the start of `bytes`.
fn chars(bytes: &[u8]) -> usize {
    let valid = match std::str::from_utf8(bytes) {
        Ok(s) => s.len(),
        Err(e) => e.valid_up_to(),
    };
    String::from_utf8_lossy(&bytes[..valid]).chars().count()
}

/// The text offsets of a run of tokens: where the text of each starts, in
/// characters, `before` holding the bytes of every token before the run
/// (it grows by the run).
fn offsets(lps: &[TokenLp], before: &mut Vec<u8>) -> Vec<usize> {
    lps.iter()
        .map(|l| {
            let at = chars(before);
            before.extend_from_slice(&l.bytes);
            at
        })
        .collect()
}

/// The completions' object for `lps`: `top_logprobs` holds the top
/// alternatives and the chosen token (OpenAI: up to `logprobs + 1`
/// entries), null where the token has no logprob (the prompt's first);
/// `text_offset` counts characters of the choice's text, `before` holding
/// the bytes of every token the choice's text already had.
pub fn completion(lps: &[TokenLp], before: &mut Vec<u8>) -> Value {
    let top: Vec<Value> = lps
        .iter()
        .map(|l| match l.logprob {
            None => Value::Null,
            Some(lp) => {
                let mut m: Map<String, Value> =
                    l.top.iter().map(|(b, p)| (display(b), json!(p))).collect();
                m.entry(display(&l.bytes)).or_insert(json!(lp));
                Value::Object(m)
            }
        })
        .collect();
    json!({
        "tokens": lps.iter().map(|l| display(&l.bytes)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets(lps, before),
    })
}

/// Chat's object for `lps` (generated tokens, each with a logprob).
pub fn chat(lps: &[TokenLp]) -> Value {
    let entry = |bytes: &[u8], logprob: f32| json!({"token": display(bytes), "logprob": logprob, "bytes": bytes});
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(&l.bytes, l.logprob.unwrap_or(f32::NEG_INFINITY));
            e["top_logprobs"] = l.top.iter().map(|(b, p)| entry(b, *p)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(text: &[u8], logprob: Option<f32>, top: &[(&[u8], f32)]) -> TokenLp {
        TokenLp {
            bytes: text.to_vec(),
            logprob,
            top: top.iter().map(|(b, p)| (b.to_vec(), *p)).collect(),
        }
    }

    #[test]
    fn completions_shape_with_a_prompt_token_first_and_offsets_in_characters() {
        let lps = [
            lp(b"Hi", None, &[]),
            lp(
                " \u{e9}".as_bytes(),
                Some(-0.5),
                &[(b" a", -0.375), (" \u{e9}".as_bytes(), -0.5)],
            ),
            lp(&[0xe2, 0x82], Some(-1.0), &[(b"x", -0.125)]),
            lp(&[0xac], Some(-0.0625), &[]),
            lp(b"!", Some(-2.0), &[]),
        ];
        let mut before = Vec::new();
        let v = completion(&lps, &mut before);
        assert_eq!(
            v["tokens"],
            json!(["Hi", " \u{e9}", "bytes:\\xe2\\x82", "bytes:\\xac", "!"])
        );
        assert_eq!(
            v["token_logprobs"],
            json!([null, -0.5, -1.0, -0.0625, -2.0])
        );
        assert_eq!(v["top_logprobs"][0], Value::Null);
        // the chosen token joins the alternatives once
        assert_eq!(v["top_logprobs"][1], json!({" a": -0.375, " \u{e9}": -0.5}));
        assert_eq!(
            v["top_logprobs"][2],
            json!({"x": -0.125, "bytes:\\xe2\\x82": -1.0})
        );
        // "Hi é€!": the euro sign's two tokens both start at its character
        assert_eq!(v["text_offset"], json!([0, 2, 4, 4, 5]));
        // the next run goes on from there
        let more = completion(&[lp(b"?", Some(-0.75), &[])], &mut before);
        assert_eq!(more["text_offset"], json!([6]));
    }

    #[test]
    fn chat_shape_has_bytes_and_alternatives() {
        let v = chat(&[lp(b" a", Some(-0.25), &[(b" a", -0.25), (b" b", -2.0)])]);
        assert_eq!(
            v,
            json!({"content": [{
                "token": " a", "logprob": -0.25, "bytes": [32, 97],
                "top_logprobs": [
                    {"token": " a", "logprob": -0.25, "bytes": [32, 97]},
                    {"token": " b", "logprob": -2.0, "bytes": [32, 98]},
                ],
            }]})
        );
    }
}
