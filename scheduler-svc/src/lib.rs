//! kvlease scheduler: continuous batching on leased KV blocks.
