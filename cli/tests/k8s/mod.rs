//! The Kubernetes manifests' checker, shared by the tests of `deploy/k8s`:
//! `k8s_manifests.rs` (the manifests as written pass, and kustomize renders
//! them), `k8s_reports.rs` (mutated manifests are reported, naming what is
//! wrong) and `k8s_probes.rs` (the exec probes against a running cluster).
//!
//! No cluster is available where kvlease is built, so this is the check the
//! manifests get: every manifest parses; each container's `env` and `args` go
//! through its binary's own clap configuration (with the image's `ENV`
//! defaults from `docker/Dockerfile` underneath) and must parse and validate;
//! the container ports, Service ports, probes and Prometheus annotations must
//! match the addresses that configuration listens on and the gRPC health
//! names its server registers; every file it reads (TLS material, the model)
//! must lie on a read-only mount, TLS files on a Secret whose keys are files
//! `kvlease certs` writes; every address it calls must name a Service that
//! reaches the right binary's listener; every file a kustomization lists
//! exists and every manifest is listed.

#![allow(dead_code, unreachable_pub)] // each test binary uses a different part

mod binaries;
mod check;
mod yaml;

pub use binaries::*;
pub use check::*;
pub use yaml::*;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use clap::CommandFactory;
use kvlease_auth::SecurityArgs;
use kvlease_runtime::process::parse_without_env;
use worker_svc::backend::BackendChoice;
use yaml_rust2::{Yaml, YamlLoader};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub const MANIFESTS: &str = "deploy/k8s";
pub const DOCKERFILE: &str = "docker/Dockerfile";
/// Where the images carry the `kvlease` command (docker/Dockerfile, stage `base`).
pub const KVLEASE_IN_IMAGE: &str = "/usr/local/bin/kvlease";
/// The user the images run as (docker/Dockerfile, `USER`).
pub const IMAGE_UID: i64 = 65534;
