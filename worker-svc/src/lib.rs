//! kvlease worker: model, KV arena and forward pass over leased blocks.
