//! An mTLS cluster for the trust-boundary tests: a CA and certificates made in-process
//! (`kvlease_auth::certs`), the cache, one worker owned by the principal `scheduler` and the
//! scheduler, each with its own certificate, and channels that present any principal's
//! certificate (or none).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvlease_auth::{Roles, Security, SecurityArgs, TlsMaterial};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::{
    Error, READY_WITHIN, Service, small_worker, start_cache, start_scheduler, start_worker,
};

/// The client principals the tests issue besides the services: one per role, one without.
pub const PRINCIPALS: &[(&str, &str)] = &[
    ("alice", "client"),
    ("bob", "client"),
    ("watcher", "observer"),
    ("ops", "admin"),
    ("nobody", ""),
    // a second scheduler: holds the role, owns no worker and no session of the first one
    ("mallory", "scheduler"),
];

/// The certificates of one test process, written once (the cluster builder's health checks
/// use one process-wide client identity, `ops`).
pub fn certs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvlease-auth-it-{}", std::process::id()));
        let principals: Vec<(String, Roles)> = PRINCIPALS
            .iter()
            .map(|(n, r)| (n.to_string(), Roles::parse_list(r).unwrap_or_default()))
            .collect();
        if let Err(e) = kvlease_auth::certs::write_dir(&dir, &[], &principals) {
            panic!("cannot write test certificates: {e}");
        }
        let admin = read_material(&dir, "ops");
        kvlease::connect::set_security(Security::tls(admin));
        dir
    })
}

fn read_material(dir: &Path, name: &str) -> TlsMaterial {
    let read = |f: String| std::fs::read(dir.join(&f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    TlsMaterial {
        cert_pem: read(format!("{name}.pem")),
        key_pem: read(format!("{name}.key")),
        ca_pem: read("ca.pem".into()),
    }
}

/// The `--tls-*` flags of principal `name`.
pub fn security_args(name: &str) -> SecurityArgs {
    let dir = certs();
    SecurityArgs {
        tls_cert: Some(dir.join(format!("{name}.pem"))),
        tls_key: Some(dir.join(format!("{name}.key"))),
        tls_ca: Some(dir.join("ca.pem")),
        ..SecurityArgs::default()
    }
}

/// A channel to `addr` over mTLS as principal `name`; `None` presents no client certificate.
pub async fn channel_as(addr: std::net::SocketAddr, name: Option<&str>) -> Result<Channel, Error> {
    let dir = certs();
    let tls = match name {
        Some(name) => Security::tls(read_material(dir, name))
            .client_tls()
            .unwrap_or_default(),
        None => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(
            std::fs::read(dir.join("ca.pem")).map_err(Error::Bind)?,
        )),
    };
    let connect = |e: tonic::transport::Error| Error::Connect {
        addr,
        message: e.to_string(),
    };
    Endpoint::from_shared(format!("https://{addr}"))
        .map_err(connect)?
        .tls_config(tls)
        .map_err(connect)?
        .connect()
        .await
        .map_err(connect)
}

/// The cache, a worker owned by `scheduler` and the scheduler, all over mTLS.
#[derive(Debug)]
pub struct SecureCluster {
    pub cache: Service,
    pub worker: Service,
    pub scheduler: Service,
}

impl SecureCluster {
    /// Starts the three with the scheduler's `config` (its security is set here).
    pub async fn start(mut config: scheduler_svc::Config) -> Result<Self, Error> {
        let cache = start_cache(cache_svc::Config {
            security: security_args("cache"),
            ..cache_svc::Config::default()
        })
        .await?;
        let worker = start_worker(worker_svc::Config {
            security: security_args("worker"),
            owner: Some("scheduler".into()),
            ..small_worker()
        })
        .await?;
        config.security = security_args("scheduler");
        let scheduler =
            start_scheduler(config, &cache.url(), &[worker.url()], READY_WITHIN).await?;
        Ok(Self {
            cache,
            worker,
            scheduler,
        })
    }

    /// Stops the scheduler, then the worker and the cache.
    pub async fn stop(self) -> Result<(), Error> {
        self.scheduler.stop().await?;
        self.worker.stop().await?;
        self.cache.stop().await?;
        Ok(())
    }
}
