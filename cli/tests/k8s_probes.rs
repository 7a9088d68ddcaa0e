//! The manifests' exec probes run, with the real `kvlease` and their
//! container's environment, against a real cluster on loopback serving mTLS.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod k8s;

use std::collections::BTreeSet;
use std::path::Path;

use kvlease_auth::SecurityArgs;
use yaml_rust2::YamlLoader;

use k8s::*;

/// An `exec` probe of the manifests: its container's image name and env,
/// and its command.
struct ExecProbe {
    image: String,
    env: Vec<(String, String)>,
    command: Vec<String>,
}

fn exec_probes(tree: &Tree) -> Vec<ExecProbe> {
    let mut probes = Vec::new();
    let docs = tree
        .iter()
        .filter(|(p, _)| p.starts_with(MANIFESTS))
        .flat_map(|(_, t)| YamlLoader::load_from_str(t).unwrap());
    for doc in docs {
        for container in items(&doc["spec"]["template"]["spec"]["containers"]) {
            let image = container["image"].as_str().unwrap_or_default();
            let image = image.rsplit('/').next().unwrap_or_default();
            let image = image.split(['@', ':']).next().unwrap_or_default();
            let env: Vec<(String, String)> = items(&container["env"])
                .iter()
                .filter_map(|v| Some((text(&v["name"])?, text(&v["value"])?)))
                .collect();
            for kind in ["startupProbe", "readinessProbe", "livenessProbe"] {
                let command = strings(&container[kind]["exec"]["command"]);
                if !command.is_empty() {
                    probes.push(ExecProbe {
                        image: image.to_string(),
                        env: env.clone(),
                        command,
                    });
                }
            }
        }
    }
    probes
}

/// Where the manifests mount each service's TLS Secret.
const CERTS_MOUNT: &str = "/certs/";

/// Runs `probe` as kubelet would in its container, with this build's
/// `kvlease`: in the container's environment (its files under
/// [`CERTS_MOUNT`] taken from `certs`), the probe's address replaced by
/// `addr`. True when it exits 0.
async fn probe_passes(probe: &ExecProbe, certs: &Path, addr: std::net::SocketAddr) -> bool {
    let (written, _) = health_command(&probe.command).unwrap();
    let args: Vec<String> = probe.command[1..]
        .iter()
        .map(|a| {
            if *a == written {
                addr.to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let env: Vec<(String, String)> = probe
        .env
        .iter()
        .map(|(k, v)| match v.strip_prefix(CERTS_MOUNT) {
            Some(file) => (k.clone(), certs.join(file).to_string_lossy().into_owned()),
            None => (k.clone(), v.clone()),
        })
        .collect();
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvlease"))
            .args(&args)
            .env_clear()
            .envs(env)
            .output()
            .unwrap()
    });
    run.await.unwrap().status.success()
}

/// The exec probes, run by the real `kvlease` against a real cluster on
/// loopback that serves mTLS with certificates from `kvlease certs`, each
/// service its own, as the manifests' Secrets hold them: the CLI accepts the
/// probes' flags, reads the container's KVLEASE_TLS_* and gets SERVING for
/// each health name asked. Without the TLS variables (as kubelet's own
/// plaintext `grpc:` probe) or for a name no server registers, a probe fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_probes_pass_over_mtls_against_a_running_cluster() {
    let certs = std::env::temp_dir().join(format!("kvlease-k8s-probes-{}", std::process::id()));
    kvlease_auth::certs::write_dir(&certs, &[], &[]).unwrap();
    let security = |name: &str| SecurityArgs {
        tls_cert: Some(certs.join(format!("{name}.pem"))),
        tls_key: Some(certs.join(format!("{name}.key"))),
        tls_ca: Some(certs.join("ca.pem")),
        ..SecurityArgs::default()
    };
    // how this process's start-up health checks reach the mTLS services
    kvlease::connect::set_security(security("admin").load().unwrap());
    let mut config = kvlease::cluster::ClusterConfig::on_ports(
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        0,
        1,
    );
    config.worker = kvlease::demo::demo_worker(8);
    config.worker.security = security("worker");
    config.worker.owner = Some("scheduler".into());
    config.cache.security = security("cache");
    config.scheduler.security = security("scheduler");
    config.ready_within = std::time::Duration::from_secs(60);
    let cluster = kvlease::cluster::Cluster::start(config).await.unwrap();

    let probes = exec_probes(&tree());
    let images: BTreeSet<&str> = probes.iter().map(|p| p.image.as_str()).collect();
    assert_eq!(
        images,
        BTreeSet::from(["kvlease-cache", "kvlease-scheduler", "kvlease-worker"]),
        "every gRPC service has exec probes"
    );
    let addr_of = |image: &str| match image {
        "kvlease-cache" => cluster.cache,
        "kvlease-scheduler" => cluster.scheduler,
        _ => cluster.workers[0],
    };
    for probe in &probes {
        let addr = addr_of(&probe.image);
        assert!(
            probe_passes(probe, &certs, addr).await,
            "{}: {:?} fails against {addr}",
            probe.image,
            probe.command
        );
    }
    let probe = &probes[0];
    let plaintext = ExecProbe {
        image: probe.image.clone(),
        env: probe
            .env
            .iter()
            .filter(|(k, _)| !k.starts_with("KVLEASE_TLS_"))
            .cloned()
            .collect(),
        command: probe.command.clone(),
    };
    assert_ne!(
        plaintext.env, probe.env,
        "the first probe's container has TLS env"
    );
    assert!(!probe_passes(&plaintext, &certs, addr_of(&probe.image)).await);
    let unserved = ExecProbe {
        image: probe.image.clone(),
        env: probe.env.clone(),
        command: probe
            .command
            .iter()
            .map(|a| {
                if a.starts_with("kvlease.v1.") {
                    "kvlease.v1.Nothing".to_string()
                } else {
                    a.clone()
                }
            })
            .collect(),
    };
    assert_ne!(
        unserved.command, probe.command,
        "the first probe names a service"
    );
    assert!(!probe_passes(&unserved, &certs, addr_of(&probe.image)).await);
    cluster.shutdown().await;
    std::fs::remove_dir_all(&certs).unwrap();
}
