//! The Kubernetes manifests (`deploy/k8s`) checked against the binaries they
//! run. No cluster is available where kvlease is built, so this is the check
//! they get: every manifest parses; each container's `env` and `args` go
//! through its binary's own clap configuration (with the image's `ENV`
//! defaults from `docker/Dockerfile` underneath) and must parse and validate;
//! the container ports, Service ports, probes and Prometheus annotations must
//! match the addresses that configuration listens on and the gRPC health
//! names its server registers; every file it reads (TLS material, the model)
//! must lie on a read-only mount, TLS files on a Secret whose keys are files
//! `kvlease certs` writes; every address it calls must name a Service that
//! reaches the right binary's listener; every file a kustomization lists
//! exists and every manifest is listed. The `reports_*` tests feed the
//! checker mutated manifests and assert it names what is wrong. The exec
//! probes also run, with the real `kvlease` and their container's
//! environment, against a real cluster on loopback serving mTLS.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

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
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const MANIFESTS: &str = "deploy/k8s";
const DOCKERFILE: &str = "docker/Dockerfile";
/// Where the images carry the `kvlease` command (docker/Dockerfile, stage `base`).
const KVLEASE_IN_IMAGE: &str = "/usr/local/bin/kvlease";
/// The user the images run as (docker/Dockerfile, `USER`).
const IMAGE_UID: i64 = 65534;

// === the binaries ===

/// One service binary as the manifests may run it.
struct Binary {
    /// Image name as docker/build.sh builds it, and the binary's name.
    image: &'static str,
    /// The docker/Dockerfile stage that builds the image.
    stage: &'static str,
    /// The principal of its certificate (`kvlease certs` writes NAME.pem and NAME.key).
    principal: &'static str,
    /// gRPC health names its server reports SERVING (the whole server and
    /// its one service); empty for an HTTP server.
    health: Vec<&'static str>,
    /// HTTP paths a probe may ask an HTTP server for.
    http_health: &'static [&'static str],
    command: fn() -> clap::Command,
    parse: fn(&[String]) -> Result<Served, String>,
}

/// What a container's configuration makes its binary do.
#[derive(Debug)]
struct Served {
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    tls: bool,
    /// Files it reads: (flag, path).
    files: Vec<(&'static str, PathBuf)>,
    /// Services it calls: (flag, address, image of the binary it must reach).
    calls: Vec<(&'static str, String, &'static str)>,
    /// The CUDA device ordinal, when its backend may be CUDA.
    gpu_device: Option<usize>,
    /// The only principal whose Forward calls a worker serves.
    owner: Option<String>,
}

impl Served {
    fn new(listen: SocketAddr, metrics: Option<SocketAddr>, security: &SecurityArgs) -> Self {
        let files = [
            ("--tls-cert", &security.tls_cert),
            ("--tls-key", &security.tls_key),
            ("--tls-ca", &security.tls_ca),
            ("--token-file", &security.token_file),
        ]
        .into_iter()
        .filter_map(|(flag, path)| path.clone().map(|p| (flag, p)))
        .collect();
        Self {
            listen,
            metrics,
            tls: security.tls_cert.is_some(),
            files,
            calls: Vec::new(),
            gpu_device: None,
            owner: None,
        }
    }
}

fn parse<C: clap::Args>(name: &'static str, argv: &[String]) -> Result<C, String> {
    parse_without_env::<C, _, _>(name, argv).map_err(|e| e.to_string())
}

fn parse_cache(argv: &[String]) -> Result<Served, String> {
    let c: cache_svc::Config = parse("kvlease-cache", argv)?;
    c.validate()?;
    Ok(Served::new(c.listen, c.metrics_listen, &c.security))
}

fn parse_scheduler(argv: &[String]) -> Result<Served, String> {
    let c: scheduler_svc::Config = parse("kvlease-scheduler", argv)?;
    c.validate().map_err(|e| e.to_string())?;
    let mut served = Served::new(c.listen, c.metrics_listen, &c.security);
    served
        .files
        .extend(c.salt_secret_file.map(|p| ("--salt-secret-file", p)));
    served
        .calls
        .push(("--cache-addr", c.cache_addr.clone(), "kvlease-cache"));
    for addr in c.worker_addrs.iter().filter(|a| !a.trim().is_empty()) {
        served
            .calls
            .push(("--worker-addrs", addr.trim().to_string(), "kvlease-worker"));
    }
    Ok(served)
}

fn parse_worker(argv: &[String]) -> Result<Served, String> {
    let c: worker_svc::Config = parse("kvlease-worker", argv)?;
    c.validate().map_err(|e| e.to_string())?;
    let mut served = Served::new(c.listen, c.metrics_listen, &c.security);
    served.files.extend(c.model.clone().map(|p| ("--model", p)));
    served
        .files
        .extend(c.weights.clone().map(|p| ("--weights", p)));
    served.gpu_device = (c.backend != BackendChoice::Cpu).then_some(c.gpu_device);
    served.owner = c.owner.clone();
    Ok(served)
}

fn parse_gateway(argv: &[String]) -> Result<Served, String> {
    let c: kvlease_gateway::Config = parse("kvlease-gateway", argv)?;
    c.validate()?;
    let mut served = Served::new(c.listen, None, &c.security);
    served.calls.push((
        "--scheduler-addr",
        c.scheduler_addr.clone(),
        "kvlease-scheduler",
    ));
    Ok(served)
}

fn binaries() -> Vec<Binary> {
    use kvlease_proto::v1::{cache_service_server, scheduler_server, worker_service_server};
    // "" is the whole server: tonic-health's reporter answers it SERVING from
    // the start; kvlease_runtime::serve sets the one service SERVING.
    vec![
        Binary {
            image: "kvlease-cache",
            stage: "cache",
            principal: "cache",
            health: vec!["", cache_service_server::SERVICE_NAME],
            http_health: &[],
            command: cache_svc::Config::command,
            parse: parse_cache,
        },
        Binary {
            image: "kvlease-scheduler",
            stage: "scheduler",
            principal: "scheduler",
            health: vec!["", scheduler_server::SERVICE_NAME],
            http_health: &[],
            command: scheduler_svc::Config::command,
            parse: parse_scheduler,
        },
        Binary {
            image: "kvlease-worker",
            stage: "worker",
            principal: "worker",
            health: vec!["", worker_service_server::SERVICE_NAME],
            http_health: &[],
            command: worker_svc::Config::command,
            parse: parse_worker,
        },
        Binary {
            image: "kvlease-gateway",
            stage: "gateway",
            principal: "gateway",
            health: Vec::new(),
            http_health: &["/health"],
            command: kvlease_gateway::Config::command,
            parse: parse_gateway,
        },
    ]
}

/// Environment variables every binary reads outside clap (kvlease_telemetry::init).
const TELEMETRY_ENV: &[&str] = &[
    kvlease_telemetry::ENV_OTLP_ENDPOINT,
    kvlease_telemetry::ENV_OTLP_TIMEOUT,
    kvlease_telemetry::ENV_SERVICE_NAME,
    kvlease_telemetry::ENV_LOG_FILTER,
    kvlease_telemetry::ENV_TRACE_FILTER,
    kvlease_telemetry::ENV_BSP_MAX_QUEUE_SIZE,
    kvlease_telemetry::ENV_BSP_SCHEDULE_DELAY,
    kvlease_telemetry::ENV_BSP_MAX_EXPORT_BATCH_SIZE,
];

/// The command line equivalent to `env` over `image_env` and then `args`:
/// every variable becomes the flag that reads it (`args` win, as with clap),
/// so the whole configuration parses without touching this process's
/// environment. A variable no flag reads is a problem.
fn argv_of(
    bin: &Binary,
    image_env: &[(String, String)],
    env: &[(String, String)],
    args: &[String],
    problems: &mut Vec<String>,
) -> Vec<String> {
    let command = (bin.command)();
    let by_env: BTreeMap<String, &clap::Arg> = command
        .get_arguments()
        .filter_map(|a| Some((a.get_env()?.to_str()?.to_string(), a)))
        .collect();
    let given: BTreeSet<&str> = args
        .iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a))
        .collect();
    let mut from_env: BTreeMap<String, String> = BTreeMap::new();
    for (i, (name, value)) in image_env.iter().chain(env).enumerate() {
        if TELEMETRY_ENV.contains(&name.as_str()) {
            continue;
        }
        match by_env.get(name).and_then(|a| a.get_long()) {
            Some(long) if !given.contains(long) => {
                let flag = match by_env[name].get_action() {
                    // clap's reading of a flag's variable: only these are false
                    clap::ArgAction::SetTrue => (!matches!(
                        value.to_ascii_lowercase().as_str(),
                        "" | "n" | "no" | "f" | "false" | "off" | "0"
                    ))
                    .then(|| format!("--{long}")),
                    _ => Some(format!("--{long}={value}")),
                };
                from_env.insert(long.to_string(), flag.unwrap_or_default());
            }
            Some(_) => {}
            None if i < image_env.len() => {
                problems.push(format!(
                    "image ENV {name}: {} reads no such variable",
                    bin.image
                ));
            }
            None => problems.push(format!("env {name}: {} reads no such variable", bin.image)),
        }
    }
    std::iter::once(bin.image.to_string())
        .chain(from_env.into_values().filter(|f| !f.is_empty()))
        .chain(args.iter().cloned())
        .collect()
}

/// `ENV` lines of one docker/Dockerfile stage; checks that the stage builds
/// on `base` (which carries `kvlease`) and runs the binary.
fn image_env(dockerfile: &str, bin: &Binary, problems: &mut Vec<String>) -> Vec<(String, String)> {
    let mut stage = String::new();
    let mut env = Vec::new();
    let mut from_base = false;
    let mut entrypoint = None;
    let mut base_has_kvlease = false;
    for line in dockerfile.lines().map(str::trim) {
        if let Some(from) = line.strip_prefix("FROM ") {
            let words: Vec<&str> = from.split_whitespace().collect();
            stage = words.last().copied().unwrap_or_default().to_string();
            if stage == bin.stage {
                from_base = words.first() == Some(&"base");
            }
        } else if stage == "base" && line == format!("COPY bin/kvlease {KVLEASE_IN_IMAGE}") {
            base_has_kvlease = true;
        } else if stage == bin.stage {
            if let Some(pair) = line.strip_prefix("ENV ") {
                if let Some((k, v)) = pair.split_once('=') {
                    env.push((k.to_string(), v.to_string()));
                }
            } else if let Some(e) = line.strip_prefix("ENTRYPOINT ") {
                entrypoint = Some(e.to_string());
            }
        }
    }
    if !from_base || !base_has_kvlease {
        problems.push(format!(
            "{DOCKERFILE}: stage {} must build FROM base, which must copy {KVLEASE_IN_IMAGE} (the probes run it)",
            bin.stage
        ));
    }
    if entrypoint != Some(format!("[\"/usr/local/bin/{}\"]", bin.image)) {
        problems.push(format!(
            "{DOCKERFILE}: stage {} does not run /usr/local/bin/{}",
            bin.stage, bin.image
        ));
    }
    env
}

// === YAML access ===

fn text(y: &Yaml) -> Option<String> {
    match y {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Integer(i) => Some(i.to_string()),
        Yaml::Real(r) => Some(r.clone()),
        Yaml::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

fn items(y: &Yaml) -> &[Yaml] {
    y.as_vec().map(Vec::as_slice).unwrap_or_default()
}

fn strings(y: &Yaml) -> Vec<String> {
    items(y).iter().filter_map(text).collect()
}

/// A mapping of strings to strings (labels, annotations, selectors).
fn string_map(y: &Yaml) -> BTreeMap<String, String> {
    y.as_hash()
        .map(|h| {
            h.iter()
                .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
                .collect()
        })
        .unwrap_or_default()
}

/// `host:port` of a URL or a bare address.
fn host_port(addr: &str) -> Option<(String, u16)> {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    Some((host.to_string(), port.parse().ok()?))
}

// === the checker ===

/// One workload's pod template, as the checks need it.
struct Pod {
    id: String,
    labels: BTreeMap<String, String>,
    /// (container image, containerPorts as (name, port), gRPC listen port).
    containers: Vec<PodContainer>,
}

/// A Service: its ports (port -> targetPort) and selector.
struct Service {
    ports: BTreeMap<u16, Yaml>,
    selector: BTreeMap<String, String>,
}

struct PodContainer {
    image: String,
    ports: Vec<(Option<String>, u16)>,
    listen: Option<u16>,
}

fn resolve_port(port: &Yaml, ports: &[(Option<String>, u16)]) -> Option<u16> {
    match port {
        Yaml::Integer(p) => u16::try_from(*p).ok(),
        Yaml::String(name) => ports
            .iter()
            .find(|(n, _)| n.as_deref() == Some(name.as_str()))
            .map(|(_, p)| *p),
        _ => None,
    }
}

/// Everything the checker reads: `(path relative to the root, contents)`.
type Tree = Vec<(String, String)>;

/// The manifests under deploy/k8s and the Dockerfile.
fn tree() -> Tree {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root().join(MANIFESTS), &mut files);
    files.push(root().join(DOCKERFILE));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (rel, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// The files `kvlease certs` writes (a CA, then NAME.pem and NAME.key per
/// principal), found by writing them once.
fn cert_files() -> &'static BTreeSet<String> {
    static NAMES: OnceLock<BTreeSet<String>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvlease-k8s-certs-{}", std::process::id()));
        kvlease_auth::certs::write_dir(&dir, &[], &[]).unwrap();
        let names = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        names
    })
}

/// Every problem of the manifests in `tree`, each naming where it is; empty when sound.
fn check(tree: &Tree) -> Vec<String> {
    let mut problems = Vec::new();
    let dockerfile = tree
        .iter()
        .find(|(p, _)| p == DOCKERFILE)
        .map(|(_, t)| t.as_str())
        .unwrap_or_default();
    let mut docs: Vec<(String, Yaml)> = Vec::new();
    for (path, contents) in tree {
        if !path.starts_with(MANIFESTS) {
            continue;
        }
        if !(path.ends_with(".yaml") || path.ends_with(".yml")) {
            problems.push(format!("{path}: not a YAML manifest"));
            continue;
        }
        match YamlLoader::load_from_str(contents) {
            Ok(ds) => docs.extend(ds.into_iter().map(|d| (path.clone(), d))),
            Err(e) => problems.push(format!("{path}: {e}")),
        }
    }
    check_kustomizations(tree, &docs, &mut problems);

    let certs = cert_files();
    let bins = binaries();
    let mut pods = Vec::new();
    let mut calls = Vec::new();
    let mut owners = Vec::new();
    let mut scheduler_principals = BTreeSet::new();
    let claims: BTreeSet<String> = docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("PersistentVolumeClaim"))
        .filter_map(|(_, d)| text(&d["metadata"]["name"]))
        .collect();
    for (path, doc) in &docs {
        let kind = doc["kind"].as_str().unwrap_or_default();
        if !matches!(kind, "Deployment" | "StatefulSet") {
            continue;
        }
        let id = format!(
            "{path}: {kind}/{}",
            doc["metadata"]["name"].as_str().unwrap_or("?")
        );
        let template = &doc["spec"]["template"];
        let labels = string_map(&template["metadata"]["labels"]);
        for (k, v) in string_map(&doc["spec"]["selector"]["matchLabels"]) {
            if labels.get(&k) != Some(&v) {
                problems.push(format!(
                    "{id}: selector {k}={v} does not match its pod labels"
                ));
            }
        }
        let annotations = string_map(&template["metadata"]["annotations"]);
        let spec = &template["spec"];
        let pod_security = &spec["securityContext"];
        if pod_security["runAsNonRoot"].as_bool() != Some(true)
            || pod_security["runAsUser"].as_i64() != Some(IMAGE_UID)
        {
            problems.push(format!("{id}: pod must run as non-root uid {IMAGE_UID}"));
        }
        let volumes: BTreeMap<String, &Yaml> = items(&spec["volumes"])
            .iter()
            .filter_map(|v| Some((text(&v["name"])?, v)))
            .collect();
        for volume in volumes.values() {
            let claim = &volume["persistentVolumeClaim"]["claimName"];
            if let Some(claim) = text(claim)
                && !claims.contains(&claim)
            {
                problems.push(format!(
                    "{id}: volume claims {claim}, which no manifest defines"
                ));
            }
        }
        let mut pod = Pod {
            id: id.clone(),
            labels,
            containers: Vec::new(),
        };
        for container in items(&spec["containers"]) {
            let cid = format!(
                "{id}: container {}",
                container["name"].as_str().unwrap_or("?")
            );
            let image = container["image"].as_str().unwrap_or_default();
            let name = image.rsplit('/').next().unwrap_or_default();
            let name = name.split(['@', ':']).next().unwrap_or_default();
            let ports: Vec<(Option<String>, u16)> = items(&container["ports"])
                .iter()
                .filter_map(|p| {
                    let port = u16::try_from(p["containerPort"].as_i64()?).ok()?;
                    Some((p["name"].as_str().map(str::to_string), port))
                })
                .collect();
            let mut record = PodContainer {
                image: name.to_string(),
                ports: ports.clone(),
                listen: None,
            };
            let Some(bin) = bins.iter().find(|b| b.image == name) else {
                problems.push(format!(
                    "{cid}: image {image:?} is none that docker/build.sh builds"
                ));
                pod.containers.push(record);
                continue;
            };
            let Some(served) = check_config(&cid, bin, container, dockerfile, &mut problems) else {
                pod.containers.push(record);
                continue;
            };
            record.listen = Some(served.listen.port());
            let one = Container {
                cid: &cid,
                bin,
                container,
                served: &served,
                ports: &ports,
            };
            one.container(&mut problems);
            one.probes(&mut problems);
            one.scrape(&annotations, &mut problems);
            one.files(&volumes, certs, &mut problems);
            one.gpu(&mut problems);
            if bin.image == "kvlease-scheduler"
                && let Some((_, cert)) = served.files.iter().find(|(f, _)| *f == "--tls-cert")
                && let Some(stem) = cert.file_stem()
            {
                scheduler_principals.insert(stem.to_string_lossy().into_owned());
            }
            owners.extend(served.owner.clone().map(|o| (cid.clone(), o)));
            calls.extend(served.calls.into_iter().map(|c| (cid.clone(), c)));
            pod.containers.push(record);
        }
        pods.push(pod);
    }
    for (cid, owner) in owners {
        if !scheduler_principals.contains(&owner) {
            problems.push(format!(
                "{cid}: --owner {owner} is not the principal of any scheduler's certificate ({scheduler_principals:?})"
            ));
        }
    }
    let services = check_services(&docs, &pods, &mut problems);
    for (cid, (flag, addr, want)) in calls {
        check_call(&cid, flag, &addr, want, &services, &pods, &mut problems);
    }
    let seen: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| p.containers.iter().map(|c| c.image.as_str()))
        .collect();
    for bin in &bins {
        if !seen.contains(bin.image) {
            problems.push(format!("{MANIFESTS}: nothing runs {}", bin.image));
        }
    }
    problems
}

/// The container's env and args through its binary's clap configuration.
fn check_config(
    cid: &str,
    bin: &Binary,
    container: &Yaml,
    dockerfile: &str,
    problems: &mut Vec<String>,
) -> Option<Served> {
    let command = strings(&container["command"]);
    if !command.is_empty() && command != [format!("/usr/local/bin/{}", bin.image)] {
        problems.push(format!(
            "{cid}: command {command:?} replaces the image's entrypoint /usr/local/bin/{}",
            bin.image
        ));
    }
    let mut env = Vec::new();
    for var in items(&container["env"]) {
        let name = var["name"].as_str().unwrap_or_default().to_string();
        match &var["value"] {
            Yaml::String(v) => env.push((name, v.clone())),
            _ => problems.push(format!(
                "{cid}: env {name}: value must be a YAML string (quote it); valueFrom is not checked"
            )),
        }
    }
    let mut found = Vec::new();
    let image_env = image_env(dockerfile, bin, problems);
    let argv = argv_of(
        bin,
        &image_env,
        &env,
        &strings(&container["args"]),
        &mut found,
    );
    problems.extend(found.into_iter().map(|p| format!("{cid}: {p}")));
    match (bin.parse)(&argv) {
        Ok(served) => Some(served),
        Err(e) => {
            let first = e.lines().next().unwrap_or_default();
            problems.push(format!(
                "{cid}: {} {argv:?} does not start: {first}",
                bin.image
            ));
            None
        }
    }
}

/// `kvlease health ADDR [--service NAME] [--timeout-ms N]`: (addr, service).
fn health_command(command: &[String]) -> Result<(String, String), String> {
    let mut words = command.iter();
    if words.next().map(String::as_str) != Some(KVLEASE_IN_IMAGE)
        || words.next().map(String::as_str) != Some("health")
    {
        return Err(format!(
            "exec probe {command:?} is not `{KVLEASE_IN_IMAGE} health`"
        ));
    }
    let (mut addr, mut service) = (None, String::new());
    while let Some(word) = words.next() {
        let (flag, inline) = match word.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (word.as_str(), None),
        };
        let mut value = || inline.clone().or_else(|| words.next().cloned());
        match flag {
            "--service" => service = value().ok_or("--service takes a value")?,
            "--timeout-ms" => {
                value()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or("--timeout-ms takes a number")?;
            }
            f if f.starts_with('-') => return Err(format!("kvlease health has no flag {f}")),
            _ if addr.is_none() => addr = Some(word.clone()),
            _ => {
                return Err(format!(
                    "kvlease health takes one address, not also {word:?}"
                ));
            }
        }
    }
    Ok((addr.ok_or("kvlease health needs an address")?, service))
}

/// One service container and what its configuration makes it do: the
/// checks of one container.
struct Container<'a> {
    cid: &'a str,
    bin: &'a Binary,
    container: &'a Yaml,
    served: &'a Served,
    ports: &'a [(Option<String>, u16)],
}

impl Container<'_> {
    /// Listen addresses against containerPorts; resources; securityContext.
    fn container(&self, problems: &mut Vec<String>) {
        let Self {
            cid,
            bin,
            container,
            served,
            ports,
        } = *self;
        let listening: Vec<SocketAddr> = std::iter::once(served.listen)
            .chain(served.metrics)
            .collect();
        for addr in &listening {
            if !addr.ip().is_unspecified() {
                problems.push(format!(
                    "{cid}: {} listens on {addr}, which its Service cannot reach (use 0.0.0.0)",
                    bin.image
                ));
            }
            if !ports.iter().any(|(_, p)| *p == addr.port()) {
                problems.push(format!(
                    "{cid}: listens on port {} but declares no containerPort for it",
                    addr.port()
                ));
            }
        }
        for (name, port) in ports {
            if !listening.iter().any(|a| a.port() == *port) {
                problems.push(format!(
                    "{cid}: containerPort {port} ({}) is not a port {} listens on ({listening:?})",
                    name.as_deref().unwrap_or("unnamed"),
                    bin.image
                ));
            }
        }
        let resources = &container["resources"];
        for (part, what) in [
            ("requests", "cpu"),
            ("requests", "memory"),
            ("limits", "cpu"),
            ("limits", "memory"),
        ] {
            if text(&resources[part][what]).is_none() {
                problems.push(format!("{cid}: no resources.{part}.{what}"));
            }
        }
        let security = &container["securityContext"];
        if security["readOnlyRootFilesystem"].as_bool() != Some(true)
            || security["allowPrivilegeEscalation"].as_bool() != Some(false)
        {
            problems.push(format!(
            "{cid}: securityContext must set readOnlyRootFilesystem: true and allowPrivilegeEscalation: false"
        ));
        }
    }

    /// Each probe asks a port the binary serves for something it answers.
    fn probes(&self, problems: &mut Vec<String>) {
        let (cid, bin, served) = (self.cid, self.bin, self.served);
        let grpc = !bin.health.is_empty();
        for kind in ["startupProbe", "readinessProbe", "livenessProbe"] {
            let probe = &self.container[kind];
            if probe.is_badvalue() {
                if kind != "startupProbe" {
                    problems.push(format!("{cid}: no {kind}"));
                }
                continue;
            }
            let at = format!("{cid}: {kind}");
            let port_of = |y: &Yaml| resolve_port(y, self.ports);
            if !probe["grpc"].is_badvalue() {
                let service = probe["grpc"]["service"].as_str().unwrap_or_default();
                if !grpc || port_of(&probe["grpc"]["port"]) != Some(served.listen.port()) {
                    problems.push(format!(
                        "{at}: grpc probe on a port that serves no gRPC health"
                    ));
                } else if !bin.health.contains(&service) {
                    problems.push(format!(
                        "{at}: {} reports no health for service {service:?}",
                        bin.image
                    ));
                }
                if served.tls {
                    problems.push(format!(
                    "{at}: kubelet's grpc probe speaks plaintext, the listener mTLS only: use `kvlease health`"
                ));
                }
            } else if !probe["exec"].is_badvalue() {
                match health_command(&strings(&probe["exec"]["command"])) {
                    Err(e) => problems.push(format!("{at}: {e}")),
                    Ok((addr, service)) => {
                        let local =
                            host_port(&addr).filter(|(h, _)| h == "127.0.0.1" || h == "localhost");
                        if !grpc || local.map(|(_, p)| p) != Some(served.listen.port()) {
                            problems.push(format!(
                            "{at}: `kvlease health {addr}` is not this pod's gRPC listener 127.0.0.1:{}",
                            served.listen.port()
                        ));
                        } else if !bin.health.iter().any(|h| *h == service) {
                            problems.push(format!(
                                "{at}: {} reports no health for service {service:?}",
                                bin.image
                            ));
                        }
                    }
                }
            } else if !probe["httpGet"].is_badvalue() {
                let path = probe["httpGet"]["path"].as_str().unwrap_or("/");
                if grpc || port_of(&probe["httpGet"]["port"]) != Some(served.listen.port()) {
                    problems.push(format!("{at}: httpGet on a port that serves no HTTP"));
                } else if !bin.http_health.contains(&path) {
                    problems.push(format!("{at}: {} serves no {path}", bin.image));
                }
            } else if !probe["tcpSocket"].is_badvalue() {
                let listened = port_of(&probe["tcpSocket"]["port"]).is_some_and(|p| {
                    p == served.listen.port() || Some(p) == served.metrics.map(|m| m.port())
                });
                if !listened {
                    problems.push(format!(
                        "{at}: tcpSocket on a port {} does not listen on",
                        bin.image
                    ));
                }
            } else {
                problems.push(format!("{at}: no grpc, exec, httpGet or tcpSocket handler"));
            }
        }
    }

    /// Prometheus annotations point at the metrics listener, and one exists iff they do.
    fn scrape(&self, annotations: &BTreeMap<String, String>, problems: &mut Vec<String>) {
        let Self { cid, served, .. } = *self;
        let scrape = annotations.get("prometheus.io/scrape").map(String::as_str) == Some("true");
        match served.metrics {
            Some(metrics) if scrape => {
                let port = annotations
                    .get("prometheus.io/port")
                    .and_then(|p| p.parse::<u16>().ok());
                if port != Some(metrics.port()) {
                    problems.push(format!(
                        "{cid}: prometheus.io/port {port:?} is not the metrics listener's port {}",
                        metrics.port()
                    ));
                }
                let path = annotations
                    .get("prometheus.io/path")
                    .map_or("/metrics", String::as_str);
                if path != "/metrics" {
                    problems.push(format!("{cid}: prometheus.io/path {path} is not /metrics"));
                }
            }
            Some(metrics) => problems.push(format!(
                "{cid}: metrics on {metrics} but no prometheus.io/scrape: \"true\""
            )),
            None if scrape => problems.push(format!(
                "{cid}: prometheus.io/scrape but no metrics listener"
            )),
            None => {}
        }
    }

    /// Every file the binary reads lies on a read-only mount; TLS files on a
    /// Secret item named like a file `kvlease certs` writes, its own certificate
    /// that of its principal.
    fn files(
        &self,
        volumes: &BTreeMap<String, &Yaml>,
        certs: &BTreeSet<String>,
        problems: &mut Vec<String>,
    ) {
        let Self {
            cid,
            bin,
            container,
            served,
            ..
        } = *self;
        let mounts: Vec<(String, String, bool)> = items(&container["volumeMounts"])
            .iter()
            .filter_map(|m| {
                Some((
                    text(&m["mountPath"])?,
                    text(&m["name"])?,
                    m["readOnly"].as_bool() == Some(true),
                ))
            })
            .collect();
        for (mount, volume, _) in &mounts {
            if !volumes.contains_key(volume) {
                problems.push(format!(
                    "{cid}: {mount} mounts volume {volume}, which the pod does not define"
                ));
            }
        }
        for (flag, path) in &served.files {
            let mount = mounts
                .iter()
                .filter(|(m, _, _)| path.starts_with(m))
                .max_by_key(|(m, _, _)| m.len());
            let Some((mount, volume, read_only)) = mount else {
                problems.push(format!(
                    "{cid}: {flag} {} is on no volume mount",
                    path.display()
                ));
                continue;
            };
            if !read_only {
                problems.push(format!(
                    "{cid}: {mount} (holding {flag}) is not mounted readOnly"
                ));
            }
            let Some(volume) = volumes.get(volume) else {
                continue;
            };
            let inside = path
                .strip_prefix(mount)
                .unwrap_or(path)
                .to_string_lossy()
                .into_owned();
            let tls = flag.starts_with("--tls-");
            let secret = &volume["secret"];
            if tls && secret.is_badvalue() {
                problems.push(format!(
                    "{cid}: {flag} {} is not on a Secret volume",
                    path.display()
                ));
                continue;
            }
            if !tls
                && volume["persistentVolumeClaim"].is_badvalue()
                && volume["hostPath"].is_badvalue()
                && secret.is_badvalue()
            {
                problems.push(format!(
                "{cid}: {flag} {} is on neither a Secret, a PersistentVolumeClaim nor a hostPath",
                path.display()
            ));
            }
            if !secret.is_badvalue() && !secret["items"].is_badvalue() {
                let item = items(&secret["items"])
                    .iter()
                    .find(|i| text(&i["path"]).as_deref() == Some(inside.as_str()));
                match item.and_then(|i| text(&i["key"])) {
                    None => problems.push(format!(
                        "{cid}: {flag} {} is no item of Secret volume {mount}",
                        path.display()
                    )),
                    Some(key) if tls && !certs.contains(&key) => problems.push(format!(
                        "{cid}: Secret key {key} is not a file `kvlease certs` writes ({certs:?})"
                    )),
                    Some(_) => {}
                }
            }
            if *flag == "--tls-cert" && path.file_stem().is_some_and(|s| s != bin.principal) {
                problems.push(format!(
                    "{cid}: --tls-cert {} is not the {} certificate {}.pem",
                    path.display(),
                    bin.image,
                    bin.principal
                ));
            }
        }
    }

    /// A CUDA worker asks for at least the GPU it uses; a CPU one asks for none.
    fn gpu(&self, problems: &mut Vec<String>) {
        let Self {
            cid,
            container,
            served,
            ..
        } = *self;
        let gpus = |part: &str| {
            text(&container["resources"][part]["nvidia.com/gpu"])
                .and_then(|g| g.parse::<usize>().ok())
        };
        match (served.gpu_device, gpus("limits")) {
            (Some(device), Some(n)) if device < n => {}
            (Some(device), n) => problems.push(format!(
                "{cid}: the CUDA backend uses device {device} but limits.nvidia.com/gpu is {n:?}"
            )),
            (None, Some(n)) => {
                problems.push(format!("{cid}: asks for {n} GPUs but runs the cpu backend"))
            }
            (None, None) => {}
        }
    }
}

/// Services: selectors select a workload whose containers declare the target
/// ports; a StatefulSet's governing Service exists and is headless.
fn check_services(
    docs: &[(String, Yaml)],
    pods: &[Pod],
    problems: &mut Vec<String>,
) -> BTreeMap<String, Service> {
    let mut services = BTreeMap::new();
    let mut headless = BTreeSet::new();
    for (path, doc) in docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("Service"))
    {
        let name = text(&doc["metadata"]["name"]).unwrap_or_default();
        let id = format!("{path}: Service/{name}");
        let selector = string_map(&doc["spec"]["selector"]);
        let selected: Vec<&Pod> = pods
            .iter()
            .filter(|p| {
                !selector.is_empty() && selector.iter().all(|(k, v)| p.labels.get(k) == Some(v))
            })
            .collect();
        if selected.is_empty() {
            problems.push(format!(
                "{id}: its selector {selector:?} selects no workload"
            ));
        }
        let mut ports = BTreeMap::new();
        for port in items(&doc["spec"]["ports"]) {
            let Some(number) = port["port"].as_i64().and_then(|p| u16::try_from(p).ok()) else {
                problems.push(format!("{id}: a port without a number"));
                continue;
            };
            let target = match &port["targetPort"] {
                Yaml::BadValue => Yaml::Integer(i64::from(number)),
                t => t.clone(),
            };
            for pod in &selected {
                if !pod
                    .containers
                    .iter()
                    .any(|c| resolve_port(&target, &c.ports).is_some())
                {
                    problems.push(format!(
                        "{id}: targetPort {:?} is no containerPort of {}",
                        text(&target).unwrap_or_default(),
                        pod.id
                    ));
                }
            }
            ports.insert(number, target);
        }
        if doc["spec"]["clusterIP"].as_str() == Some("None") {
            headless.insert(name.clone());
        }
        services.insert(name, Service { ports, selector });
    }
    for (path, doc) in docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("StatefulSet"))
    {
        let name = text(&doc["spec"]["serviceName"]).unwrap_or_default();
        if !headless.contains(&name) {
            problems.push(format!(
                "{path}: StatefulSet serviceName {name:?} is no headless Service"
            ));
        }
    }
    services
}

/// An address a binary calls names a Service port that reaches the gRPC
/// listener of the binary it means.
fn check_call(
    cid: &str,
    flag: &str,
    addr: &str,
    want: &str,
    services: &BTreeMap<String, Service>,
    pods: &[Pod],
    problems: &mut Vec<String>,
) {
    let Some((host, port)) = host_port(addr) else {
        problems.push(format!("{cid}: {flag} {addr} is not host:port"));
        return;
    };
    // `name`, `name.namespace`, `name.namespace.svc[.cluster.local]`
    let name = host.split('.').next().unwrap_or_default();
    let Some(Service { ports, selector }) = services.get(name) else {
        problems.push(format!("{cid}: {flag} {addr}: there is no Service {name}"));
        return;
    };
    let Some(target) = ports.get(&port) else {
        problems.push(format!(
            "{cid}: {flag} {addr}: Service {name} has no port {port}"
        ));
        return;
    };
    let reached = pods
        .iter()
        .filter(|p| selector.iter().all(|(k, v)| p.labels.get(k) == Some(v)))
        .flat_map(|p| &p.containers)
        .any(|c| {
            c.image == want && c.listen.is_some() && resolve_port(target, &c.ports) == c.listen
        });
    if !reached {
        problems.push(format!(
            "{cid}: {flag} {addr}: Service {name} port {port} does not reach the gRPC listener of {want}"
        ));
    }
}

/// Every file a kustomization lists exists; every manifest is listed.
fn check_kustomizations(tree: &Tree, docs: &[(String, Yaml)], problems: &mut Vec<String>) {
    let files: BTreeSet<&str> = tree.iter().map(|(p, _)| p.as_str()).collect();
    let mut listed = BTreeSet::new();
    let mut any = false;
    for (path, doc) in docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("Kustomization"))
    {
        any = true;
        listed.insert(path.clone());
        let dir = Path::new(path).parent().unwrap_or(Path::new(""));
        for resource in strings(&doc["resources"]) {
            let file = dir.join(&resource).to_string_lossy().into_owned();
            let kustomized_dir = dir
                .join(&resource)
                .join("kustomization.yaml")
                .to_string_lossy()
                .into_owned();
            if files.contains(file.as_str()) {
                listed.insert(file);
            } else if !files.contains(kustomized_dir.as_str()) {
                problems.push(format!("{path}: resource {resource} does not exist"));
            }
        }
    }
    if !any {
        problems.push(format!("{MANIFESTS}: no kustomization.yaml"));
    }
    for (path, _) in tree.iter().filter(|(p, _)| p.starts_with(MANIFESTS)) {
        if !listed.contains(path) {
            problems.push(format!("{path}: listed in no kustomization.yaml"));
        }
    }
}

// === the tests ===

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
