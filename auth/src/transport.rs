//! Transport security of every kvlease server and client: the flags (`--tls-cert`,
//! `--tls-key`, `--tls-ca`, `--insecure`, `--token-file`, with the same environment
//! fallbacks in every binary), the material they name, loaded once, and what it configures:
//! tonic's rustls server (client certificates verified against the CA, optional so that
//! bearer-token callers can connect) and client endpoints (`https://`, the service's own
//! certificate as client identity, the server's checked against the CA, its host name and
//! the service dialed: [`crate::identity`]).
//!
//! Without TLS material a server serves plaintext: on a loopback listener by default (what
//! `kvlease demo`/`up` and tests do), anywhere only with `--insecure`. On loopback, which no
//! other host reaches, it says so at INFO; anywhere else it logs a warning.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

use crate::error::{Error, Result};
use crate::identity::{self, ServiceKind};
use crate::tokens::Tokens;

/// The transport security flags, flattened into every service's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct SecurityArgs {
    /// PEM certificate this service serves with and presents to the services it calls.
    #[arg(long, env = "KVLEASE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVLEASE_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate that client and server certificates must chain to.
    #[arg(long, env = "KVLEASE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Serve and call in plaintext, also on non-loopback addresses (logged as a warning).
    #[arg(long, env = "KVLEASE_INSECURE", conflicts_with_all = ["tls_cert", "tls_key", "tls_ca"])]
    pub insecure: bool,
    /// Bearer tokens this server accepts: lines `TOKEN PRINCIPAL ROLE[,ROLE]`.
    #[arg(long, env = "KVLEASE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

/// The PEM material of a TLS service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsMaterial {
    /// This service's certificate (chain), PEM.
    pub cert_pem: Vec<u8>,
    /// Its private key, PEM.
    pub key_pem: Vec<u8>,
    /// The CA every peer's certificate must chain to, PEM.
    pub ca_pem: Vec<u8>,
}

/// A service's transport security, loaded: TLS material (none for plaintext), whether
/// plaintext was asked for explicitly, and the bearer tokens it accepts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Security {
    tls: Option<Arc<TlsMaterial>>,
    insecure: bool,
    tokens: Option<Arc<Tokens>>,
}

/// How long a TLS handshake may take before the connection is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl SecurityArgs {
    /// Reads the files the flags name.
    pub fn load(&self) -> Result<Security> {
        let tls = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(Arc::new(TlsMaterial {
                cert_pem: read("--tls-cert", cert)?,
                key_pem: read("--tls-key", key)?,
                ca_pem: read("--tls-ca", ca)?,
            })),
            (None, None, None) => None,
            _ => {
                return Err(Error::Config(
                    "--tls-cert, --tls-key and --tls-ca go together".into(),
                ));
            }
        };
        if tls.is_some() && self.insecure {
            return Err(Error::Config("--insecure contradicts --tls-cert".into()));
        }
        let tokens = match &self.token_file {
            Some(path) => Some(Arc::new(Tokens::read(path)?)),
            None => None,
        };
        Ok(Security {
            tls,
            insecure: self.insecure,
            tokens,
        })
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

impl Security {
    /// Plaintext, on loopback listeners only (the default of tests and `kvlease up`).
    pub fn loopback() -> Self {
        Self::default()
    }

    /// Plaintext anywhere (`--insecure`).
    pub fn insecure() -> Self {
        Self {
            insecure: true,
            ..Self::default()
        }
    }

    /// mTLS with `material`.
    pub fn tls(material: TlsMaterial) -> Self {
        Self {
            tls: Some(Arc::new(material)),
            ..Self::default()
        }
    }

    /// The same, also accepting the bearer tokens of `tokens`.
    pub fn with_tokens(self, tokens: Tokens) -> Self {
        Self {
            tokens: Some(Arc::new(tokens)),
            ..self
        }
    }

    /// The TLS material; none for plaintext.
    pub fn material(&self) -> Option<&TlsMaterial> {
        self.tls.as_deref()
    }

    /// The bearer tokens this server accepts; none when it takes no tokens.
    pub fn tokens(&self) -> Option<&Tokens> {
        self.tokens.as_deref()
    }

    /// Whether connections are plaintext.
    pub fn is_plaintext(&self) -> bool {
        self.tls.is_none()
    }

    /// Checks that a server may listen on `addr` (plaintext beyond loopback takes
    /// `--insecure`) and logs plaintext: at INFO on loopback, a warning elsewhere.
    pub fn check_listener(&self, service: &str, addr: SocketAddr) -> Result<()> {
        if self.tls.is_some() {
            return Ok(());
        }
        if !self.insecure && !addr.ip().is_loopback() {
            return Err(Error::Config(format!(
                "{service} would serve plaintext on {addr}, which is not a loopback address: \
                 give --tls-cert/--tls-key/--tls-ca, or --insecure to mean it"
            )));
        }
        if addr.ip().is_loopback() {
            tracing::info!(
                service,
                %addr,
                "serving plaintext gRPC on loopback (no --tls-cert)"
            );
        } else {
            tracing::warn!(
                service,
                %addr,
                "serving plaintext gRPC without authentication of peers (no --tls-cert)"
            );
        }
        Ok(())
    }

    /// The rustls server configuration: this service's identity, client certificates
    /// checked against the CA. A client without one may still connect and present a bearer
    /// token; the authorization layer refuses calls that bring neither.
    pub fn server_tls(&self) -> Option<ServerTlsConfig> {
        let m = self.tls.as_ref()?;
        Some(
            ServerTlsConfig::new()
                .identity(Identity::from_pem(&m.cert_pem, &m.key_pem))
                .client_ca_root(Certificate::from_pem(&m.ca_pem))
                .client_auth_optional(true)
                .timeout(TLS_HANDSHAKE_TIMEOUT),
        )
    }

    /// The rustls client configuration: the CA to check servers against, this service's
    /// certificate as its identity.
    pub fn client_tls(&self) -> Option<ClientTlsConfig> {
        let m = self.tls.as_ref()?;
        Some(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&m.ca_pem))
                .identity(Identity::from_pem(&m.cert_pem, &m.key_pem))
                .timeout(TLS_HANDSHAKE_TIMEOUT),
        )
    }

    /// An endpoint for `addr` (`host:port` or a URL) of the service `expected`: `https://`
    /// under TLS, `http://` otherwise. Under TLS the server must present a certificate of the
    /// CA, valid for the host, that names `expected` (`kvlease://service/NAME`); a handshake
    /// with any other service fails, naming the service expected and the one presented.
    /// `None` accepts any server the CA vouches for (a health check of whatever serves
    /// there). The error says what is wrong with the address or the TLS material.
    pub fn endpoint(&self, addr: &str, expected: Option<ServiceKind>) -> Result<Endpoint, String> {
        let hostport = addr
            .strip_prefix("http://")
            .or_else(|| addr.strip_prefix("https://"))
            .unwrap_or(addr);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{hostport}");
        let endpoint = Endpoint::from_shared(url).map_err(|e| e.to_string())?;
        let Some(m) = self.tls.as_ref() else {
            return Ok(endpoint);
        };
        let tls = ClientTlsConfig::new()
            .identity(Identity::from_pem(&m.cert_pem, &m.key_pem))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        match expected {
            None => endpoint.tls_config(tls.ca_certificate(Certificate::from_pem(&m.ca_pem))),
            Some(service) => {
                // The verifier holds the CA: tonic refuses one given twice.
                let verifier = identity::verifier(&m.ca_pem, service).map_err(|e| e.to_string())?;
                endpoint.tls_config_with_verifier(tls, verifier)
            }
        }
        .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// What `check_listener` logs for `addr`, one line an event.
    fn logged(security: &Security, addr: &str) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                if let Ok(mut b) = self.0.lock() {
                    b.extend_from_slice(bytes);
                }
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish();
        let addr: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
        tracing::subscriber::with_default(subscriber, || {
            security
                .check_listener("cache", addr)
                .unwrap_or_else(|e| panic!("{e}"));
        });
        let bytes = buffer.0.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[test]
    fn plaintext_on_loopback_is_info_and_elsewhere_a_warning() {
        let plain = Security::default();
        for addr in ["127.0.0.1:50051", "[::1]:50051"] {
            let log = logged(&plain, addr);
            assert!(
                log.contains(" INFO ") && log.contains("plaintext") && !log.contains("WARN"),
                "{addr}: {log}"
            );
        }
        let insecure = SecurityArgs {
            insecure: true,
            ..SecurityArgs::default()
        }
        .load()
        .unwrap_or_else(|e| panic!("{e}"));
        let log = logged(&insecure, "10.0.0.7:50051");
        assert!(
            log.contains(" WARN ") && log.contains("without authentication of peers"),
            "{log}"
        );
        assert!(
            plain
                .check_listener(
                    "cache",
                    "10.0.0.7:50051".parse().unwrap_or_else(|e| panic!("{e}"))
                )
                .is_err(),
            "plaintext off loopback takes --insecure"
        );
    }
}
