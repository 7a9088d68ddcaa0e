//! The service binaries as the manifests may run them: each one's clap
//! configuration, what a container's `env` and `args` make it serve, and the
//! image's `ENV` defaults underneath.

use super::*;

/// One service binary as the manifests may run it.
pub struct Binary {
    /// Image name as docker/build.sh builds it, and the binary's name.
    pub image: &'static str,
    /// The docker/Dockerfile stage that builds the image.
    pub stage: &'static str,
    /// The principal of its certificate (`kvlease certs` writes NAME.pem and NAME.key).
    pub principal: &'static str,
    /// gRPC health names its server reports SERVING (the whole server and
    /// its one service); empty for an HTTP server.
    pub health: Vec<&'static str>,
    /// HTTP paths a probe may ask an HTTP server for.
    pub http_health: &'static [&'static str],
    pub command: fn() -> clap::Command,
    pub parse: fn(&[String]) -> Result<Served, String>,
}

/// What a container's configuration makes its binary do.
#[derive(Debug)]
pub struct Served {
    pub listen: SocketAddr,
    pub metrics: Option<SocketAddr>,
    pub tls: bool,
    /// Files it reads: (flag, path).
    pub files: Vec<(&'static str, PathBuf)>,
    /// Services it calls: (flag, address, image of the binary it must reach).
    pub calls: Vec<(&'static str, String, &'static str)>,
    /// The CUDA device ordinal, when its backend may be CUDA.
    pub gpu_device: Option<usize>,
    /// The only principal whose Forward calls a worker serves.
    pub owner: Option<String>,
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

pub fn parse<C: clap::Args>(name: &'static str, argv: &[String]) -> Result<C, String> {
    parse_without_env::<C, _, _>(name, argv).map_err(|e| e.to_string())
}

pub fn parse_cache(argv: &[String]) -> Result<Served, String> {
    let c: cache_svc::Config = parse("kvlease-cache", argv)?;
    c.validate()?;
    Ok(Served::new(c.listen, c.metrics_listen, &c.security))
}

pub fn parse_scheduler(argv: &[String]) -> Result<Served, String> {
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

pub fn parse_worker(argv: &[String]) -> Result<Served, String> {
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

pub fn parse_gateway(argv: &[String]) -> Result<Served, String> {
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

pub fn binaries() -> Vec<Binary> {
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
pub const TELEMETRY_ENV: &[&str] = &[
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
pub fn argv_of(
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
pub fn image_env(
    dockerfile: &str,
    bin: &Binary,
    problems: &mut Vec<String>,
) -> Vec<(String, String)> {
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
