//! Text of an output stream as its tokens arrive, and stop strings.
//!
//! [`StreamDecoder`] emits only complete text: a character whose bytes are
//! split across tokens (byte-level BPE, byte fallback) is held back until it
//! is whole, and a token's leading space is decoded in the context of the
//! token before it. Concatenating everything it emits gives exactly
//! [`Tokenizer::decode`] of the whole output.

use crate::Tokenizer;

/// Incremental detokenization (the prefix/read offsets of Hugging Face's
/// text-generation-inference): the text of the tokens since `prefix` is
/// decoded with and without the newest tokens, and the difference is new
/// text once it does not end in an incomplete character.
#[derive(Debug)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// End of the tokens whose text was emitted.
    read: usize,
    /// Bytes of the window's new text already emitted (the text before an
    /// incomplete character).
    partial: usize,
    /// Everything emitted so far.
    emitted: String,
}

impl StreamDecoder {
    pub(crate) fn new(tokenizer: Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            partial: 0,
            emitted: String::new(),
        }
    }

    /// The new complete text after `ids`.
    pub fn push(&mut self, ids: &[u32]) -> String {
        self.ids.extend_from_slice(ids);
        // a run of byte-fallback tokens (special tokens between them are
        // left out) decodes as a whole, one character or U+FFFD for each
        // byte: wait for its end
        let tok = &self.tokenizer;
        let last = self.ids.iter().rev().find(|&&id| !tok.is_special(id));
        if self.read == self.ids.len() || last.is_some_and(|&id| tok.is_byte_token(id)) {
            return String::new();
        }
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read]);
        let after = self.tokenizer.decode(&self.ids[self.prefix..]);
        let Some(new) = after.strip_prefix(&before) else {
            // the context changed the text before: wait for the end
            return String::new();
        };
        // U+FFFD at the end: a character still waiting for its bytes; the
        // text before it is final
        let complete = new.trim_end_matches('\u{FFFD}');
        let out = if complete.len() == new.len() {
            let out = new.get(self.partial..).unwrap_or_default().to_string();
            if after.len() > before.len() {
                self.prefix = self.read;
                self.read = self.ids.len();
                self.partial = 0;
            }
            out
        } else if complete.len() > self.partial {
            let out = complete[self.partial..].to_string();
            self.partial = complete.len();
            out
        } else {
            String::new()
        };
        self.emitted.push_str(&out);
        out
    }

    /// Whatever is still held back (end of the stream).
    pub fn finish(&mut self) -> String {
        let all = self.tokenizer.decode(&self.ids);
        let rest = match all.strip_prefix(&self.emitted) {
            Some(rest) => rest.to_string(),
            // not reachable for the decoders tokenizer.json can name; the
            // window's own difference is the best left to say
            None => {
                let before = self.tokenizer.decode(&self.ids[self.prefix..self.read]);
                let after = self.tokenizer.decode(&self.ids[self.prefix..]);
                after.strip_prefix(&before).unwrap_or(&after).to_string()
            }
        };
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        self.partial = 0;
        self.emitted.push_str(&rest);
        rest
    }
}

/// Stop strings over a stream of text: text that might be the start of a
/// stop string is held back; the first stop string found ends the stream,
/// and neither it nor anything after it is emitted.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopStrings {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The text of `text` that can be emitted now.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            self.pending.truncate(at);
            return std::mem::take(&mut self.pending);
        }
        // the longest tail that some stop string starts with
        let held = self
            .pending
            .char_indices()
            .map(|(at, _)| at)
            .find(|&at| {
                let tail = &self.pending[at..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let rest = self.pending.split_off(held);
        std::mem::replace(&mut self.pending, rest)
    }

    /// Emits `text`, and what was held back, without looking for stops in
    /// it: output before a request's `min_tokens`, which no stop ends.
    pub fn pass(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.pending);
        out.push_str(text);
        out
    }

    /// The text held back (end of the stream without a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}
