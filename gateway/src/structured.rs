//! Structured output over HTTP: OpenAI's `response_format`
//! (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
//! {"name", "schema", "strict"}}`) and kvlease's grammar extension
//! (`"kvlease": {"grammar": {"lark": "..."}}` or `{"regex": "..."}`), read
//! into one [`Grammar`] for the scheduler's `GenerateRequest.grammar`.
//!
//! Only the shape is checked here (each refusal names its param); the
//! scheduler compiles the grammar against the model's vocabulary and its
//! refusal (a schema llguidance cannot compile) comes back as a 400 naming
//! `response_format` or `kvlease.grammar.*` with the engine's message.

use serde_json::Value;

use crate::error::{ApiError, Result, clip};

/// What the output must follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

/// The grammar a request asks for through `response_format` or
/// `kvlease.grammar` (not both); `None` for plain text.
pub fn grammar(
    response_format: Option<&Value>,
    kvlease: Option<&Value>,
) -> Result<Option<Grammar>> {
    let from_format = response_format
        .filter(|v| !v.is_null())
        .map(read_response_format)
        .transpose()?
        .flatten();
    let extension = kvlease
        .and_then(|k| k.get("grammar"))
        .filter(|v| !v.is_null());
    let Some(ext) = extension else {
        return Ok(from_format);
    };
    if from_format.is_some() {
        return Err(ApiError::invalid_param(
            "kvlease.grammar",
            "kvlease.grammar cannot be combined with a response_format other than text",
        ));
    }
    read_extension(ext).map(Some)
}

fn read_response_format(v: &Value) -> Result<Option<Grammar>> {
    let bad = |m: String| Err(ApiError::invalid_param("response_format", m));
    let Some(obj) = v.as_object() else {
        return bad("response_format must be an object {\"type\": ...}".into());
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid_param(
                    "response_format.json_schema",
                    "response_format.json_schema must be an object {name, schema, strict}",
                ));
            };
            match js.get("schema").filter(|s| !s.is_null()) {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(Grammar::JsonSchema(schema.to_string())))
                }
                Some(other) => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    format!(
                        "response_format.json_schema.schema must be a JSON schema object, got {}",
                        clip(&other.to_string())
                    ),
                )),
                None => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    "response_format.json_schema.schema is required",
                )),
            }
        }
        Some(other) => bad(format!(
            "response_format.type {} is not one of text, json_object, json_schema",
            clip(other)
        )),
        None => bad("response_format.type is required (text, json_object or json_schema)".into()),
    }
}

fn read_extension(v: &Value) -> Result<Grammar> {
    let Some(obj) = v.as_object().filter(|o| o.len() == 1) else {
        return Err(ApiError::invalid_param(
            "kvlease.grammar",
            "kvlease.grammar must be an object with one of lark or regex",
        ));
    };
    let (kind, text) = obj
        .iter()
        .next()
        .map(|(k, t)| (k.as_str(), t))
        .unwrap_or(("", v));
    let (param, make): (&'static str, fn(String) -> Grammar) = match kind {
        "lark" => ("kvlease.grammar.lark", Grammar::Lark),
        "regex" => ("kvlease.grammar.regex", Grammar::Regex),
        other => {
            return Err(ApiError::invalid_param(
                "kvlease.grammar",
                format!(
                    "kvlease.grammar.{} is unknown (known: lark, regex; JSON goes in \
                     response_format)",
                    clip(other)
                ),
            ));
        }
    };
    match text.as_str() {
        Some(s) if !s.is_empty() => Ok(make(s.to_string())),
        _ => Err(ApiError::invalid_param(
            param,
            format!("{param} must be a non-empty string"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(format: Value, kvlease: Value) -> Result<Option<Grammar>> {
        grammar(Some(&format), Some(&kvlease))
    }

    #[test]
    fn response_formats_and_the_extension_become_grammars() {
        let none = Value::Null;
        assert_eq!(read(json!({"type": "text"}), none.clone()).unwrap(), None);
        assert_eq!(
            read(json!({"type": "json_object"}), none.clone()).unwrap(),
            Some(Grammar::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let got = read(
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
            none.clone(),
        )
        .unwrap();
        let Some(Grammar::JsonSchema(text)) = got else {
            panic!("{got:?}")
        };
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
        assert_eq!(
            read(none.clone(), json!({"grammar": {"lark": "start: \"a\""}})).unwrap(),
            Some(Grammar::Lark("start: \"a\"".into()))
        );
        assert_eq!(
            read(
                json!({"type": "text"}),
                json!({"grammar": {"regex": "[0-9]+"}})
            )
            .unwrap(),
            Some(Grammar::Regex("[0-9]+".into()))
        );
        assert_eq!(grammar(None, None).unwrap(), None);
    }

    #[test]
    fn malformed_ones_name_their_param() {
        let none = Value::Null;
        for (format, ext, param) in [
            (json!("json"), none.clone(), "response_format"),
            (json!({"type": "yaml"}), none.clone(), "response_format"),
            (json!({}), none.clone(), "response_format"),
            (
                json!({"type": "json_schema"}),
                none.clone(),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
                none.clone(),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                none.clone(),
                "response_format.json_schema.schema",
            ),
            (none.clone(), json!({"grammar": "start"}), "kvlease.grammar"),
            (
                none.clone(),
                json!({"grammar": {"ebnf": "x"}}),
                "kvlease.grammar",
            ),
            (
                none.clone(),
                json!({"grammar": {"lark": "a", "regex": "b"}}),
                "kvlease.grammar",
            ),
            (
                none.clone(),
                json!({"grammar": {"regex": ""}}),
                "kvlease.grammar.regex",
            ),
            (
                json!({"type": "json_object"}),
                json!({"grammar": {"regex": "a"}}),
                "kvlease.grammar",
            ),
        ] {
            let e = read(format.clone(), ext.clone()).expect_err("refused");
            assert_eq!(
                (e.status.as_u16(), e.param),
                (400, Some(param)),
                "{format} {ext}: {e:?}"
            );
        }
    }
}
