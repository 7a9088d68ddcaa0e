//! The seeded model's byte-level tokenizer (token ids 0..=255 are the bytes,
//! [`BOS`] = 256, [`EOS`] = 257), from `kvlease-tokenizer`, which also has
//! the real models' tokenizers.

pub use kvlease_tokenizer::byte_level::{BOS, EOS, VOCAB_SIZE, decode, encode};
