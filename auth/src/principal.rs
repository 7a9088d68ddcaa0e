//! Who is calling: a principal's name and roles, from its client certificate or bearer token.

use std::fmt;
use std::sync::Arc;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer as _, X509Certificate};

use crate::roles::{Role, Roles};

/// The SAN URI prefix that names a principal in a certificate.
pub const PRINCIPAL_URI: &str = "kvlease://principal/";
/// The SAN URI prefix of a role a certificate grants; the CA vouches for it like for the name.
pub const ROLE_URI: &str = "kvlease://role/";
/// The principal of plaintext loopback callers when a server takes no tokens.
pub const ANONYMOUS: &str = "anonymous";

/// How a principal proved who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// A client certificate signed by the server's CA.
    Certificate,
    /// A bearer token from the server's token file.
    Token,
    /// Nothing: a plaintext caller on loopback, on a server without a token file.
    Loopback,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    name: Arc<str>,
    roles: Roles,
    proof: Proof,
}

impl Principal {
    /// A principal `name` with `roles`; `None` when the name is not [a valid name](valid_name).
    pub fn new(name: &str, roles: Roles, proof: Proof) -> Option<Self> {
        valid_name(name).then(|| Self {
            name: name.into(),
            roles,
            proof,
        })
    }

    /// The anonymous loopback caller of a plaintext server: every role.
    pub fn anonymous() -> Self {
        Self {
            name: ANONYMOUS.into(),
            roles: Roles::all(),
            proof: Proof::Loopback,
        }
    }

    /// The principal's name (safe to log: see [`valid_name`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its roles.
    pub fn roles(&self) -> Roles {
        self.roles
    }

    /// How it proved who it is.
    pub fn proof(&self) -> Proof {
        self.proof
    }

    /// Whether it holds `role` (or `admin`).
    pub fn has(&self, role: Role) -> bool {
        self.roles.grants(role)
    }

    /// The principal of the leaf certificate `der`: the name from a
    /// `kvlease://principal/NAME` SAN URI, else the subject's common name; the roles from
    /// `kvlease://role/ROLE` SAN URIs (unknown roles are ignored, so an older server accepts a
    /// newer CA's certificates). `None` when the certificate does not parse or names nobody.
    pub fn from_certificate(der: &[u8]) -> Option<Self> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let mut name = None;
        let mut roles = Roles::NONE;
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for general in &san.value.general_names {
                if let GeneralName::URI(uri) = general {
                    if let Some(n) = uri.strip_prefix(PRINCIPAL_URI) {
                        name.get_or_insert(n.to_string());
                    } else if let Some(role) = uri.strip_prefix(ROLE_URI)
                        && let Ok(role) = role.parse::<Role>()
                    {
                        roles = roles.with(role);
                    }
                }
            }
        }
        let name = match name {
            Some(n) => n,
            None => cert
                .subject()
                .iter_common_name()
                .next()?
                .as_str()
                .ok()?
                .to_string(),
        };
        Self::new(&name, roles, Proof::Certificate)
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (roles {})", self.name, self.roles)
    }
}

/// Principal names are 1 to 64 characters of `[A-Za-z0-9._-]`: they reach logs, metrics and
/// cache salts, and cannot forge a log line.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_restricted_to_a_log_safe_set() {
        assert!(valid_name("sched-0.a_b"));
        assert!(!valid_name(""));
        assert!(!valid_name("a\nforged line"));
        assert!(!valid_name(&"x".repeat(65)));
        assert!(Principal::new("bad name", Roles::NONE, Proof::Token).is_none());
        assert_eq!(
            Principal::anonymous().to_string(),
            "anonymous (roles scheduler,client,observer,admin)"
        );
    }

    #[test]
    fn certificates_name_their_principal_and_roles() {
        let ca = crate::certs::Authority::new().unwrap();
        let issued = ca
            .client("alice", Roles::parse_list("client,observer").unwrap())
            .unwrap();
        let p = Principal::from_certificate(&issued.der).unwrap();
        assert_eq!(p.name(), "alice");
        assert_eq!(p.roles(), Roles::parse_list("client,observer").unwrap());
        assert_eq!(p.proof(), Proof::Certificate);
        assert!(Principal::from_certificate(b"not a certificate").is_none());
    }
}
