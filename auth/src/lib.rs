//! kvlease's trust boundary, shared by every service and client: who a caller is, what it may
//! call, and the transport that carries both.
//!
//! # Layout
//! - [`roles`]: the four roles (`scheduler`, `client`, `observer`, `admin`) and sets of them.
//! - [`principal`]: an authenticated caller, named by its client certificate
//!   (`kvlease://principal/NAME` SAN URI or common name, `kvlease://role/ROLE` SAN URIs) or
//!   by a bearer token ([`tokens`]: a token file of `TOKEN PRINCIPAL ROLES` lines).
//! - [`identity`]: which service a certificate belongs to (`kvlease://service/SERVICE` SAN
//!   URI), checked by every client against the service it dials.
//! - [`matrix`]: the authorization matrix, one table for every RPC of every service.
//! - [`layer`]: the tower layer that applies identification and the matrix to every call and
//!   hands services the [`Principal`] for their ownership checks.
//! - [`transport`]: the `--tls-*`/`--insecure`/`--token-file` flags, the rustls server and
//!   client configuration.
//! - [`certs`]: certificates made by the project (`kvlease certs`, tests, compose).
//! - [`salt`]: tenant cache salts, an HMAC under a server secret.

#![forbid(unsafe_code)]

pub mod certs;
mod error;
pub mod identity;
pub mod layer;
pub mod matrix;
pub mod principal;
pub mod roles;
pub mod salt;
pub mod tokens;
pub mod transport;

pub use error::{Error, Result};
pub use identity::ServiceKind;
pub use layer::{AuthLayer, principal_of};
pub use principal::Principal;
pub use roles::{Role, Roles};
pub use transport::{Security, SecurityArgs, TlsMaterial};
