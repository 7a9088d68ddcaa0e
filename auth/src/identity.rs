//! Which service a certificate belongs to, and the check that a connection reached the
//! service it dialed.
//!
//! A service's certificate names what it is in a `kvlease://service/SERVICE` SAN URI
//! (`cache`, `worker`, `scheduler`, `gateway`), vouched for by the CA like its principal and
//! roles. A client that dials a service checks, after the CA and the host name, that the
//! server's certificate names that service: host names alone do not tell services apart (the
//! compose certificates are all valid for every service's host name), so without this a
//! worker started with the gateway's key was accepted by the scheduler and sent prompts
//! (issue 29, finding 6). Roles bind what a caller may do to its certificate; this binds what
//! a server is to its own.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{DigitallySignedStruct, OtherError, RootCertStore, SignatureScheme};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer as _, X509Certificate};

use crate::error::{Error, Result};
use crate::principal::Principal;

/// The SAN URI prefix that names the service a certificate belongs to.
pub const SERVICE_URI: &str = "kvlease://service/";

/// The kvlease services, as their certificates name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServiceKind {
    /// The cache service: the scheduler dials it.
    Cache,
    /// A worker: the scheduler dials it and sends it prompts.
    Worker,
    /// The scheduler: clients and the gateway dial it.
    Scheduler,
    /// The HTTP gateway: serves HTTP only, dials the scheduler.
    Gateway,
}

impl ServiceKind {
    /// Every service.
    pub const ALL: [ServiceKind; 4] = [
        ServiceKind::Cache,
        ServiceKind::Worker,
        ServiceKind::Scheduler,
        ServiceKind::Gateway,
    ];

    /// The service's name in certificates and messages.
    pub fn name(self) -> &'static str {
        match self {
            ServiceKind::Cache => "cache",
            ServiceKind::Worker => "worker",
            ServiceKind::Scheduler => "scheduler",
            ServiceKind::Gateway => "gateway",
        }
    }

    /// Its SAN URI, `kvlease://service/NAME`.
    pub fn uri(self) -> String {
        format!("{SERVICE_URI}{}", self.name())
    }
}

impl fmt::Display for ServiceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ServiceKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        ServiceKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::Config(format!(
                    "unknown service {s:?} (services: cache, worker, scheduler, gateway)"
                ))
            })
    }
}

/// The services the certificate `der` names in `kvlease://service/` SAN URIs, as written
/// (a name this build does not know is kept, for the message that refuses it).
pub fn services_of(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|general| match general {
            GeneralName::URI(uri) => uri.strip_prefix(SERVICE_URI).map(str::to_string),
            _ => None,
        })
        .collect()
}

/// Why the certificate `der`, presented by `host`, is not that of service `expected`; `None`
/// when it names `expected`.
pub fn mismatch(der: &[u8], host: &str, expected: ServiceKind) -> Option<String> {
    let services = services_of(der);
    if services.iter().any(|s| s == expected.name()) {
        return None;
    }
    let presented = match services.as_slice() {
        [] => "no service identity".to_string(),
        names => format!("service {}", names.join(",")),
    };
    // The principal only helps the reader: names are log-safe (`valid_name`).
    let principal = Principal::from_certificate(der).map_or_else(
        || "no principal".to_string(),
        |p| format!("principal {}", p.name()),
    );
    Some(format!(
        "{host} is not the {expected}: expected service {expected} ({}), \
         presented {presented} ({principal})",
        expected.uri()
    ))
}

/// The server certificate check of a client that dials `expected`: the CA in `ca_pem`
/// and the host name (rustls' WebPKI verifier), then [`mismatch`].
pub fn verifier(ca_pem: &[u8], expected: ServiceKind) -> Result<Arc<dyn ServerCertVerifier>> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| Error::Config(format!("--tls-ca: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::Config(format!("--tls-ca: {e}")))?;
    }
    let inner = WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(ring::default_provider()),
    )
    .build()
    .map_err(|e| Error::Config(format!("--tls-ca: {e}")))?;
    Ok(Arc::new(ExpectService { inner, expected }))
}

/// [`verifier`]'s verifier.
#[derive(Debug)]
struct ExpectService {
    inner: Arc<WebPkiServerVerifier>,
    expected: ServiceKind,
}

/// A refused identity, as rustls carries it to the caller.
#[derive(Debug)]
struct WrongService(String);

impl fmt::Display for WrongService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongService {}

impl ServerCertVerifier for ExpectService {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        // The CA first: an identity means something only in a certificate it vouches for.
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        match mismatch(end_entity, &server_name.to_str(), self.expected) {
            None => Ok(verified),
            Some(why) => {
                tracing::warn!(expected = %self.expected, why, "server refused: wrong service identity");
                Err(tokio_rustls::rustls::Error::Other(OtherError(Arc::new(
                    WrongService(why),
                ))))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::Authority;
    use crate::roles::{Role, Roles};

    #[test]
    fn service_names_parse_and_print() {
        for kind in ServiceKind::ALL {
            assert_eq!(kind.name().parse::<ServiceKind>().unwrap(), kind);
        }
        assert_eq!(ServiceKind::Worker.uri(), "kvlease://service/worker");
        let e = "db".parse::<ServiceKind>().unwrap_err().to_string();
        assert!(e.contains("\"db\""), "{e}");
    }

    #[test]
    fn a_certificate_matches_only_the_service_it_names() {
        let ca = Authority::new().unwrap();
        let gateway = ca
            .service(
                "gateway",
                ServiceKind::Gateway,
                Roles::NONE.with(Role::Client),
                &[],
            )
            .unwrap();
        assert_eq!(services_of(&gateway.der), ["gateway"]);
        assert_eq!(mismatch(&gateway.der, "gw", ServiceKind::Gateway), None);
        let why = mismatch(&gateway.der, "127.0.0.1", ServiceKind::Worker).unwrap();
        assert_eq!(
            why,
            "127.0.0.1 is not the worker: expected service worker (kvlease://service/worker), \
             presented service gateway (principal gateway)"
        );
        // a client certificate names no service
        let alice = ca.client("alice", Roles::NONE.with(Role::Client)).unwrap();
        let why = mismatch(&alice.der, "h", ServiceKind::Cache).unwrap();
        assert!(
            why.contains("presented no service identity (principal alice)"),
            "{why}"
        );
        assert!(verifier(b"not pem", ServiceKind::Cache).is_err());
        assert!(verifier(ca.ca_pem().as_bytes(), ServiceKind::Cache).is_ok());
    }
}
