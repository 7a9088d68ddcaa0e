//! The checker of `k8s/` fed mutated manifests: each must be reported,
//! naming what is wrong, so a passing check of the real manifests is not
//! vacuous.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod k8s;

use k8s::*;

/// `tree` with the first `from` in `file` replaced by `to` (which must be there).
fn mutated(file: &str, from: &str, to: &str) -> Tree {
    let mut tree = tree();
    let (_, text) = tree
        .iter_mut()
        .find(|(p, _)| p == file)
        .unwrap_or_else(|| panic!("no {file}"));
    assert!(text.contains(from), "{file} has no {from:?}");
    *text = text.replacen(from, to, 1);
    tree
}

#[track_caller]
fn assert_reports(tree: &Tree, needle: &str) {
    let problems = check(tree);
    assert!(
        problems.iter().any(|p| p.contains(needle)),
        "expected a problem containing {needle:?}, got:\n  {}",
        problems.join("\n  ")
    );
}

/// A broken manifest: in `file`, `from` replaced by `to`; the checker must
/// report a problem containing `needle`.
struct Broken {
    file: &'static str,
    from: &'static str,
    to: &'static str,
    needle: &'static str,
}

const fn broken(
    file: &'static str,
    from: &'static str,
    to: &'static str,
    needle: &'static str,
) -> Broken {
    Broken {
        file,
        from,
        to,
        needle,
    }
}

#[track_caller]
fn assert_each_reported(cases: &[Broken]) {
    for case in cases {
        assert_reports(&mutated(case.file, case.from, case.to), case.needle);
    }
}

const CACHE: &str = "deploy/k8s/cache.yaml";
const WORKER_A: &str = "deploy/k8s/worker-a.yaml";
const SCHEDULER: &str = "deploy/k8s/scheduler.yaml";
const GATEWAY: &str = "deploy/k8s/gateway.yaml";

#[test]
fn reports_a_misspelled_flag_or_variable_and_a_refused_value() {
    assert_each_reported(&[
        broken(
            WORKER_A,
            "[--backend, cuda]",
            "[--backnd, cuda]",
            "unexpected argument '--backnd'",
        ),
        broken(
            CACHE,
            "KVLEASE_CACHE_METRICS_LISTEN",
            "KVLEASE_CACHE_METRIC_LISTEN",
            "env KVLEASE_CACHE_METRIC_LISTEN: kvlease-cache reads no such variable",
        ),
        broken(
            SCHEDULER,
            "value: max-utilization",
            "value: max-utilisation",
            "does not start",
        ),
        // Kubernetes refuses an env value that is not a string
        broken(
            WORKER_A,
            "value: \"0\"",
            "value: 0",
            "must be a YAML string",
        ),
    ]);
}

#[test]
fn reports_ports_that_do_not_match_the_listeners() {
    let moved = ("containerPort: 50052", "containerPort: 50062");
    assert_each_reported(&[
        broken(
            CACHE,
            moved.0,
            moved.1,
            "listens on port 50052 but declares no containerPort",
        ),
        broken(
            CACHE,
            moved.0,
            moved.1,
            "containerPort 50062 (grpc) is not a port kvlease-cache listens on",
        ),
        broken(
            CACHE,
            "\"0.0.0.0:50052\"",
            "\"127.0.0.1:50052\"",
            "which its Service cannot reach",
        ),
        broken(
            GATEWAY,
            "targetPort: http",
            "targetPort: https",
            "targetPort \"https\" is no containerPort",
        ),
        broken(
            SCHEDULER,
            "value: cache:50052",
            "value: cache:50053",
            "Service cache has no port 50053",
        ),
        broken(
            SCHEDULER,
            ",worker-b:50053",
            ",worker-c:50053",
            "there is no Service worker-c",
        ),
        broken(
            GATEWAY,
            "value: scheduler:50051",
            "value: cache:50052",
            "does not reach the gRPC listener of kvlease-scheduler",
        ),
    ]);
}

#[test]
fn reports_probes_at_unserved_health() {
    assert_each_reported(&[
        broken(
            CACHE,
            "--service, kvlease.v1.CacheService",
            "--service, kvlease.v1.Cache",
            "kvlease-cache reports no health for service \"kvlease.v1.Cache\"",
        ),
        broken(
            WORKER_A,
            "health, \"127.0.0.1:50053\"",
            "health, \"127.0.0.1:9090\"",
            "is not this pod's gRPC listener",
        ),
        broken(
            CACHE,
            "--timeout-ms, \"2000\"",
            "--timeout, \"2000\"",
            "kvlease health has no flag --timeout",
        ),
        // kubelet's own gRPC probe cannot present a client certificate
        broken(
            SCHEDULER,
            "exec:\n              command: [/usr/local/bin/kvlease, health, \"127.0.0.1:50051\", --timeout-ms, \"2000\"]",
            "grpc:\n              port: 50051",
            "kubelet's grpc probe speaks plaintext",
        ),
        broken(
            GATEWAY,
            "path: /health",
            "path: /healthz",
            "kvlease-gateway serves no /healthz",
        ),
    ]);
}

#[test]
fn reports_scrape_annotations_off_the_metrics_port() {
    assert_each_reported(&[
        broken(
            SCHEDULER,
            "prometheus.io/port: \"9090\"",
            "prometheus.io/port: \"50051\"",
            "is not the metrics listener's port 9090",
        ),
        broken(
            WORKER_A,
            "scrape: \"true\"",
            "scrape: \"false\"",
            "but no prometheus.io/scrape",
        ),
    ]);
}

#[test]
fn reports_tls_files_the_secret_mount_does_not_hold() {
    assert_each_reported(&[
        broken(
            CACHE,
            "{ key: cache.key, path: cache.key }",
            "{ key: cache.key, path: key.pem }",
            "--tls-key /certs/cache.key is no item of Secret volume /certs",
        ),
        broken(
            CACHE,
            "value: /certs/ca.pem",
            "value: /etc/ca.pem",
            "--tls-ca /etc/ca.pem is on no volume mount",
        ),
        broken(
            GATEWAY,
            "{ key: ca.pem, path: ca.pem }",
            "{ key: root.pem, path: ca.pem }",
            "Secret key root.pem is not a file `kvlease certs` writes",
        ),
        broken(
            SCHEDULER,
            "value: /certs/scheduler.pem",
            "value: /certs/gateway.pem",
            "is not the kvlease-scheduler certificate scheduler.pem",
        ),
        broken(
            WORKER_A,
            "value: scheduler\n",
            "value: gateway\n",
            "--owner gateway is not the principal",
        ),
    ]);
}

#[test]
fn reports_a_gpu_worker_without_a_gpu_and_a_model_off_its_volume() {
    assert_each_reported(&[
        broken(
            WORKER_A,
            "memory: 8Gi\n              nvidia.com/gpu: 1\n",
            "memory: 8Gi\n",
            "the CUDA backend uses device 0 but limits.nvidia.com/gpu is None",
        ),
        broken(
            WORKER_A,
            "[--backend, cuda]",
            "[--backend, cpu]",
            "runs the cpu backend",
        ),
        broken(
            WORKER_A,
            "mountPath: /models",
            "mountPath: /model",
            "--model /models/smollm2",
        ),
        broken(
            WORKER_A,
            "claimName: kvlease-models",
            "claimName: models",
            "claims models",
        ),
    ]);
}

#[test]
fn reports_a_loose_security_context_and_an_unknown_image() {
    assert_each_reported(&[
        broken(
            CACHE,
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesystem: false",
            "readOnlyRootFilesystem",
        ),
        broken(
            GATEWAY,
            "runAsUser: 65534",
            "runAsUser: 0",
            "non-root uid 65534",
        ),
        broken(
            CACHE,
            "image: kvlease-cache:dev",
            "image: kvlease-kache:dev",
            "is none that docker/build.sh builds",
        ),
    ]);
}

#[test]
fn reports_kustomization_files_that_are_missing_or_unlisted() {
    let tree = mutated(
        "deploy/k8s/kustomization.yaml",
        "  - gateway.yaml\n",
        "  - gateway.yml\n",
    );
    assert_reports(&tree, "resource gateway.yml does not exist");
    assert_reports(
        &tree,
        "deploy/k8s/gateway.yaml: listed in no kustomization.yaml",
    );
    // dropping a workload from the manifests is reported, not passed
    let tree: Tree = tree.into_iter().filter(|(p, _)| p != GATEWAY).collect();
    assert_reports(&tree, "nothing runs kvlease-gateway");
}
