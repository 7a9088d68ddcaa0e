//! Certificates made by the project (`kvlease certs`, tests, the compose test): one CA, and
//! for each principal a key and a certificate that names it (`kvlease://principal/NAME` SAN
//! URI and common name), grants its roles (`kvlease://role/ROLE` SAN URIs) and, for services,
//! says which service it is (`kvlease://service/SERVICE`, checked by the clients that dial it:
//! [`crate::identity`]) and the host names and addresses clients reach it at. Every certificate is good for both ends of
//! a connection (server and client authentication): the scheduler serves with the same
//! certificate it presents to the cache and the workers.
//!
//! These are for development, tests and compose: long-lived, no revocation. A production
//! deployment brings its own PKI; the services only need a CA, a certificate and a key.

use std::net::IpAddr;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::error::{Error, Result};
use crate::identity::ServiceKind;
use crate::principal::{PRINCIPAL_URI, ROLE_URI, valid_name};
use crate::roles::{Role, Roles};

/// A certificate authority held in memory.
#[derive(Debug)]
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// One issued certificate and its key.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM (PKCS#8).
    pub key_pem: String,
    /// The certificate, DER.
    pub der: Vec<u8>,
}

impl Authority {
    /// A new CA with a fresh key.
    pub fn new() -> Result<Self> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "kvlease development CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The CA certificate, PEM: what every service and client trusts.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for principal `name` with `roles`, of the service `service` (none for a
    /// client), valid for the host names and addresses in `hosts` (none for a client that
    /// serves nothing).
    pub fn issue(
        &self,
        name: &str,
        roles: Roles,
        service: Option<ServiceKind>,
        hosts: &[String],
    ) -> Result<Issued> {
        if !valid_name(name) {
            return Err(Error::Config(format!(
                "bad principal name {name:?}: 1 to 64 of [A-Za-z0-9._-]"
            )));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        let mut sans = vec![uri(&format!("{PRINCIPAL_URI}{name}"))?];
        for role in roles.iter() {
            sans.push(uri(&format!("{ROLE_URI}{role}"))?);
        }
        if let Some(service) = service {
            sans.push(uri(&service.uri())?);
        }
        for host in hosts {
            sans.push(match host.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(host.as_str().try_into()?),
            });
        }
        params.subject_alt_names = sans;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        })
    }

    /// A client certificate (no host names) for `name` with `roles`.
    pub fn client(&self, name: &str, roles: Roles) -> Result<Issued> {
        self.issue(name, roles, None, &[])
    }

    /// A certificate of service `service` for principal `name` with `roles`, valid for
    /// `name`, `localhost`, `127.0.0.1` and `extra_hosts`.
    pub fn service(
        &self,
        name: &str,
        service: ServiceKind,
        roles: Roles,
        extra_hosts: &[String],
    ) -> Result<Issued> {
        let mut hosts = vec![name.to_string(), "localhost".into(), "127.0.0.1".into()];
        hosts.extend(extra_hosts.iter().cloned());
        self.issue(name, roles, Some(service), &hosts)
    }
}

fn uri(s: &str) -> Result<SanType> {
    Ok(SanType::URI(s.try_into()?))
}

/// The services `kvlease certs` issues certificates for (each named after its service), with
/// their roles: the cache and the workers only serve; the scheduler calls both; the gateway
/// calls the scheduler as a client.
pub const SERVICES: &[(ServiceKind, &[Role])] = &[
    (ServiceKind::Cache, &[]),
    (ServiceKind::Worker, &[]),
    (ServiceKind::Scheduler, &[Role::Scheduler]),
    (ServiceKind::Gateway, &[Role::Client]),
];

/// The client principals `kvlease certs` issues by default: one per role.
pub const CLIENTS: &[(&str, &[Role])] = &[
    ("admin", &[Role::Admin]),
    ("client", &[Role::Client]),
    ("observer", &[Role::Observer]),
];

/// Writes a CA and the certificates of [`SERVICES`] (valid also for `extra_hosts`),
/// [`CLIENTS`] and `principals` into `dir`: `ca.pem`, then `NAME.pem` and `NAME.key` each.
/// The CA's key is not written: nothing more can be signed with it. Returns the names issued.
pub fn write_dir(
    dir: &Path,
    extra_hosts: &[String],
    principals: &[(String, Roles)],
) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let ca = Authority::new()?;
    write(&dir.join("ca.pem"), &ca.ca_pem(), false)?;
    let mut names = Vec::new();
    let mut put = |name: &str, issued: Issued| -> Result<()> {
        write(&dir.join(format!("{name}.pem")), &issued.cert_pem, false)?;
        write(&dir.join(format!("{name}.key")), &issued.key_pem, true)?;
        names.push(name.to_string());
        Ok(())
    };
    for (service, roles) in SERVICES {
        let roles = roles.iter().copied().collect();
        let name = service.name();
        put(name, ca.service(name, *service, roles, extra_hosts)?)?;
    }
    for (name, roles) in CLIENTS {
        put(name, ca.client(name, roles.iter().copied().collect())?)?;
    }
    for (name, roles) in principals {
        put(name, ca.client(name, *roles)?)?;
    }
    Ok(names)
}

/// The file holding the bearer token of `admin` that [`write_local`] makes (the token alone:
/// `authorization: Bearer $(cat admin.token)`).
pub const ADMIN_TOKEN: &str = "admin.token";
/// The services' token file (`--token-file`) that [`write_local`] writes: one line, the
/// admin's token.
pub const TOKEN_FILE: &str = "tokens";

/// The credentials of a local cluster (`kvlease up --tls`): [`write_dir`] with `extra_hosts`
/// and no more principals, then a fresh bearer token of principal `admin` (role admin) in
/// [`ADMIN_TOKEN`] and as the line of [`TOKEN_FILE`], both readable by their owner only.
/// Returns the names issued.
pub fn write_local(dir: &Path, extra_hosts: &[String]) -> Result<Vec<String>> {
    let names = write_dir(dir, extra_hosts, &[])?;
    let token = crate::tokens::generate()?;
    write(&dir.join(ADMIN_TOKEN), &format!("{token}\n"), true)?;
    write(
        &dir.join(TOKEN_FILE),
        &format!("# kvlease up --tls: the local admin\n{token} admin admin\n"),
        true,
    )?;
    Ok(names)
}

fn write(path: &Path, text: &str, private: bool) -> Result<()> {
    let err = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(path, text).map_err(err)?;
    // Keys readable by their owner only; the compose images run as the same user id.
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = private;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::principal::Principal;

    #[test]
    fn write_dir_writes_a_ca_and_a_key_pair_per_principal() {
        let dir = std::env::temp_dir().join(format!("kvlease-certs-{}", std::process::id()));
        let extra = [("ops".to_string(), Roles::parse_list("admin").unwrap())];
        let names = write_dir(&dir, &["cache-1".to_string()], &extra).unwrap();
        assert_eq!(
            names,
            [
                "cache",
                "worker",
                "scheduler",
                "gateway",
                "admin",
                "client",
                "observer",
                "ops"
            ]
        );
        assert!(
            std::fs::read_to_string(dir.join("ca.pem"))
                .unwrap()
                .contains("BEGIN CERTIFICATE")
        );
        assert!(
            std::fs::read_to_string(dir.join("ops.key"))
                .unwrap()
                .contains("PRIVATE KEY")
        );
        let pem = std::fs::read_to_string(dir.join("scheduler.pem")).unwrap();
        let der = x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .unwrap()
            .1
            .contents;
        let p = Principal::from_certificate(&der).unwrap();
        assert_eq!(
            (p.name(), p.roles()),
            ("scheduler", Roles::NONE.with(Role::Scheduler))
        );
        // each service certificate names its own service, the clients' none
        for (service, _) in SERVICES {
            let pem = std::fs::read_to_string(dir.join(format!("{service}.pem"))).unwrap();
            let der = x509_parser::pem::parse_x509_pem(pem.as_bytes())
                .unwrap()
                .1
                .contents;
            assert_eq!(crate::identity::services_of(&der), [service.name()]);
        }
        let pem = std::fs::read_to_string(dir.join("admin.pem")).unwrap();
        let der = x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .unwrap()
            .1
            .contents;
        assert!(crate::identity::services_of(&der).is_empty());
        assert!(write_dir(&dir, &[], &[("bad name".into(), Roles::NONE)]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn write_local_adds_a_private_admin_token_the_token_file_names() {
        let dir = std::env::temp_dir().join(format!("kvlease-local-{}", std::process::id()));
        let names = write_local(&dir, &[]).unwrap();
        assert!(names.iter().any(|n| n == "admin"), "{names:?}");
        let token = std::fs::read_to_string(dir.join(ADMIN_TOKEN)).unwrap();
        let token = token.trim();
        assert_eq!(token.len(), 64, "{token}");
        let tokens = crate::tokens::Tokens::read(&dir.join(TOKEN_FILE)).unwrap();
        let admin = tokens.get(token).unwrap();
        assert_eq!((admin.name(), admin.has(Role::Admin)), ("admin", true));
        #[cfg(unix)]
        for file in [ADMIN_TOKEN, TOKEN_FILE] {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir.join(file))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "{file}: {mode:o}");
        }
        // a second run makes another token
        write_local(&dir, &[]).unwrap();
        let again = std::fs::read_to_string(dir.join(ADMIN_TOKEN)).unwrap();
        assert_ne!(again.trim(), token);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
