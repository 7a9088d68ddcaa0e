//! The checker: every manifest against the binaries it runs; each problem
//! found is one line of text.

use super::*;

/// One workload's pod template, as the checks need it.
pub struct Pod {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    /// (container image, containerPorts as (name, port), gRPC listen port).
    pub containers: Vec<PodContainer>,
}

/// A Service: its ports (port -> targetPort) and selector.
pub struct Service {
    pub ports: BTreeMap<u16, Yaml>,
    pub selector: BTreeMap<String, String>,
}

pub struct PodContainer {
    pub image: String,
    pub ports: Vec<(Option<String>, u16)>,
    pub listen: Option<u16>,
}

pub fn resolve_port(port: &Yaml, ports: &[(Option<String>, u16)]) -> Option<u16> {
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
pub type Tree = Vec<(String, String)>;

/// The manifests under deploy/k8s and the Dockerfile.
pub fn tree() -> Tree {
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
pub fn cert_files() -> &'static BTreeSet<String> {
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
pub fn check(tree: &Tree) -> Vec<String> {
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
pub fn check_config(
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
pub fn health_command(command: &[String]) -> Result<(String, String), String> {
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
pub struct Container<'a> {
    pub cid: &'a str,
    pub bin: &'a Binary,
    pub container: &'a Yaml,
    pub served: &'a Served,
    pub ports: &'a [(Option<String>, u16)],
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
pub fn check_services(
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
pub fn check_call(
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
pub fn check_kustomizations(tree: &Tree, docs: &[(String, Yaml)], problems: &mut Vec<String>) {
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
