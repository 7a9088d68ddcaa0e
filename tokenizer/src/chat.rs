//! Chat templates: the model's Jinja template rendered with `minijinja` the
//! way transformers' `apply_chat_template` renders it (blocks trimmed,
//! `raise_exception`, Python string methods, `add_generation_prompt`).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;

use crate::Specials;
use crate::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ... (as the template knows them).
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

const NAME: &str = "chat";

/// A parsed chat template with the model's BOS and EOS text.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Parses `source`; a template that does not parse is an error now, not
    /// at the first request.
    pub(crate) fn new(source: &str, specials: &Specials) -> Result<Self> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: specials.bos_token.clone().unwrap_or_default(),
            eos_token: specials.eos_token.clone().unwrap_or_default(),
        })
    }

    /// The prompt text of `messages`, ending with the generation prompt.
    pub(crate) fn render(&self, messages: &[Message]) -> Result<String> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::Template(e.to_string()))?;
        template
            .render(context! {
                messages => Serde(messages),
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| Error::Template(template_error(&e)))
    }
}

/// The message of a template error: a `raise_exception` says it alone.
fn template_error(e: &minijinja::Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_string(),
        _ => e.to_string(),
    }
}
