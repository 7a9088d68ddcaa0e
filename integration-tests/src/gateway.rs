//! The HTTP front for whole-system tests and benches: a gateway started on
//! `127.0.0.1:0` in front of a running scheduler, and the ChatML tokenizer
//! its chat requests need.

use std::net::SocketAddr;

use kvlease_tokenizer::{GgufVocab, Tokenizer};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::Error;

/// A gateway serving on a loopback port until [`Gateway::stop`].
#[derive(Debug)]
pub struct Gateway {
    /// Where it serves HTTP.
    pub http: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), kvlease_gateway::Error>>,
}

impl Gateway {
    /// Starts a gateway in front of the scheduler at `scheduler_url`, with
    /// the default model name and limits.
    pub async fn start(scheduler_url: String) -> Result<Gateway, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let http = listener.local_addr()?;
        let config = kvlease_gateway::Config {
            listen: http,
            scheduler_addr: scheduler_url,
            ..Default::default()
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kvlease_gateway::run(listener, config, async {
            let _ = stopped.await;
        }));
        Ok(Gateway { http, stop, task })
    }

    /// Stops it; in-flight answers end first. Its error if it failed.
    pub async fn stop(self) -> Result<(), Error> {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(served) => served.map_err(|e| Error::Gateway(e.to_string())),
            Err(e) => Err(Error::Gateway(format!("the gateway task failed: {e}"))),
        }
    }
}

/// GPT-2's printable spelling of each byte.
fn byte_alphabet() -> Vec<String> {
    let mut extra = 0u32;
    (0..=255u32)
        .map(|b| {
            let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(code).unwrap_or('?').to_string()
        })
        .collect()
}

/// A byte-level BPE over the seeded model's 258 ids with ChatML specials
/// and a ChatML template: `<|im_start|>` is 256, `<|im_end|>` (the end of
/// a turn) 257.
pub fn chatml_tokenizer() -> Result<Tokenizer, kvlease_tokenizer::Error> {
    let mut tokens = byte_alphabet();
    tokens.push("<|im_start|>".into());
    tokens.push("<|im_end|>".into());
    let mut token_types = vec![1; 256];
    token_types.extend([3, 3]);
    Tokenizer::from_gguf(&GgufVocab {
        model: "gpt2".into(),
        tokens,
        token_types,
        eos_id: Some(257),
        chat_template: Some(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
        ),
        ..Default::default()
    })
}
