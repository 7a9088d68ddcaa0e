//! `kvlease up --tls`: a local cluster that serves mTLS only, with credentials it makes
//! itself in a private directory: a development CA, one certificate per service (each naming
//! its service, checked by the peers that dial it), the client principals `admin`, `client`
//! and `observer`, and a bearer token of `admin` that every service (the HTTP gateway
//! included) accepts. Plaintext `kvlease up` makes every loopback caller an admin; here only
//! whoever can read the directory is one.

use std::path::{Path, PathBuf};

use kvlease_auth::certs::{ADMIN_TOKEN, TOKEN_FILE};
use kvlease_auth::{Security, SecurityArgs};

use crate::cluster::ClusterConfig;
use crate::error::{Error, Result};

/// The principal that owns the cluster's workers: the scheduler's certificate names it.
const SCHEDULER: &str = "scheduler";

/// The credentials of a local mTLS cluster, in their directory.
#[derive(Debug, Clone)]
pub struct LocalTls {
    dir: PathBuf,
}

impl LocalTls {
    /// Writes fresh credentials into `dir`: created readable by its owner only when missing;
    /// an existing one must be a directory no one else can read. The service certificates
    /// are valid for `localhost`, `127.0.0.1` and `hosts` too.
    pub fn create(dir: &Path, hosts: &[String]) -> Result<Self> {
        private_dir(dir)?;
        kvlease_auth::certs::write_local(dir, hosts).map_err(|e| Error::Usage(e.to_string()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `--tls-*` flags of principal `name` (a service, `admin`, `client`, `observer`),
    /// with the token file the services accept.
    pub fn args(&self, name: &str) -> SecurityArgs {
        SecurityArgs {
            tls_cert: Some(self.dir.join(format!("{name}.pem"))),
            tls_key: Some(self.dir.join(format!("{name}.key"))),
            tls_ca: Some(self.dir.join("ca.pem")),
            insecure: false,
            token_file: Some(self.dir.join(TOKEN_FILE)),
        }
    }

    /// The transport security of a client that presents `name`'s certificate.
    pub fn client(&self, name: &str) -> Result<Security> {
        SecurityArgs {
            token_file: None,
            ..self.args(name)
        }
        .load()
        .map_err(|e| Error::Usage(e.to_string()))
    }

    /// The bearer token of `admin`.
    pub fn admin_token(&self) -> Result<String> {
        let path = self.dir.join(ADMIN_TOKEN);
        std::fs::read_to_string(&path)
            .map(|t| t.trim().to_string())
            .map_err(|e| Error::Usage(format!("cannot read {}: {e}", path.display())))
    }

    /// Serves every service of `config` over mTLS with its own certificate, accepting the
    /// admin's token; the workers belong to the scheduler's principal.
    pub fn secure(&self, config: &mut ClusterConfig) {
        config.cache.security = self.args("cache");
        config.worker.security = self.args("worker");
        config.worker.owner = Some(SCHEDULER.into());
        config.scheduler.security = self.args(SCHEDULER);
    }

    /// How to reach the cluster as admin, for `kvlease up` to print.
    pub fn usage(&self) -> String {
        let d = self.dir.display();
        format!(
            "  mtls       credentials in {d} (CA ca.pem; NAME.pem/NAME.key of admin, client, \
             observer)\n             as admin: kvlease --tls-cert {d}/admin.pem --tls-key \
             {d}/admin.key --tls-ca {d}/ca.pem status\n             bearer token of admin: \
             {d}/{ADMIN_TOKEN} (authorization: Bearer TOKEN)"
        )
    }
}

/// Creates `dir` for the owner only (0700), or checks that an existing one is a directory
/// that no one else can read or write: it will hold private keys and the admin's token.
fn private_dir(dir: &Path) -> Result<()> {
    let bad = |why: String| Error::Usage(format!("--tls-dir {}: {why}", dir.display()));
    match std::fs::symlink_metadata(dir) {
        Ok(meta) => {
            if !meta.is_dir() {
                return Err(bad("not a directory".into()));
            }
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt as _;
                let mode = meta.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(bad(format!(
                        "others may read or write it (mode {mode:o}); it will hold private \
                         keys: chmod 700 it or name a new directory"
                    )));
                }
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut builder = std::fs::DirBuilder::new();
            builder.recursive(true);
            #[cfg(unix)]
            std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
            builder
                .create(dir)
                .map_err(|e| bad(format!("cannot create it: {e}")))
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_is_private_and_a_shared_one_is_refused() {
        let base = std::env::temp_dir().join(format!("kvlease-local-tls-{}", std::process::id()));
        let dir = base.join("up");
        let tls = LocalTls::create(&dir, &[]).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            let e = LocalTls::create(&dir, &[]).unwrap_err().to_string();
            assert!(e.contains("mode 755"), "{e}");
        }
        assert_eq!(tls.admin_token().unwrap().len(), 64);
        let file = base.join("file");
        std::fs::write(&file, "x").unwrap();
        let e = LocalTls::create(&file, &[]).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
