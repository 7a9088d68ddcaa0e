//! The `kvlease` command: local cluster, client, load generator, status (filled by a later issue).
