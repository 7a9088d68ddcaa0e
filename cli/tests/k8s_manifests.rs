//! The Kubernetes manifests (`deploy/k8s`) as written pass the checker of
//! `k8s/` (the check they get where no cluster is available), and where
//! `kubectl` is installed its kustomize renders every object into the
//! namespace.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod k8s;

use std::collections::BTreeSet;

use yaml_rust2::{Yaml, YamlLoader};

use k8s::*;

#[test]
fn the_manifests_match_the_binaries() {
    let tree = tree();
    let problems = check(&tree);
    assert!(
        problems.is_empty(),
        "deploy/k8s:\n  {}",
        problems.join("\n  ")
    );
    // what the check covered: not vacuous
    let docs: Vec<Yaml> = tree
        .iter()
        .filter(|(p, _)| p.starts_with(MANIFESTS))
        .flat_map(|(_, t)| YamlLoader::load_from_str(t).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    let count = |k: &str| kinds.iter().filter(|x| **x == k).count();
    assert_eq!(count("StatefulSet"), 1, "{kinds:?}");
    assert_eq!(
        count("Deployment"),
        4,
        "two worker groups, the scheduler, the gateway: {kinds:?}"
    );
    assert_eq!(count("Service"), 5, "{kinds:?}");
}

/// Where `kubectl` is installed, its kustomize renders deploy/k8s (offline:
/// no cluster is contacted) into the objects the files hold, each in
/// namespace kvlease. Skips, saying why, without `kubectl`.
#[test]
fn kustomize_renders_every_object_into_the_namespace() {
    let rendered = std::process::Command::new("kubectl")
        .args(["kustomize", MANIFESTS])
        .current_dir(root())
        .output();
    let out = match rendered {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipped: no kubectl to render {MANIFESTS} with ({e})");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kubectl kustomize {MANIFESTS}: {stderr}"
    );
    let name_of = |d: &Yaml| {
        format!(
            "{}/{}",
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["name"].as_str().unwrap_or("?")
        )
    };
    let rendered = YamlLoader::load_from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    let objects: BTreeSet<String> = rendered.iter().map(name_of).collect();
    let written: BTreeSet<String> = tree()
        .iter()
        .filter(|(p, _)| p.starts_with(MANIFESTS))
        .flat_map(|(_, t)| YamlLoader::load_from_str(t).unwrap())
        .filter(|d| d["kind"].as_str() != Some("Kustomization"))
        .map(|d| name_of(&d))
        .collect();
    assert_eq!(objects, written);
    for d in rendered
        .iter()
        .filter(|d| d["kind"].as_str() != Some("Namespace"))
    {
        assert_eq!(
            d["metadata"]["namespace"].as_str(),
            Some("kvlease"),
            "{}",
            name_of(d)
        );
    }
}
