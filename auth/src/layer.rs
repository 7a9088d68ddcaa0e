//! The authorization layer every kvlease server puts in front of its routes: it names the
//! caller ([`identify`]), asks the [matrix] whether the caller may make this
//! call, and either refuses it (UNAUTHENTICATED: no identity; PERMISSION_DENIED: a role it
//! lacks, named in the message) or hands it on with the [`Principal`] in the request's
//! extensions, where services read it ([`principal_of`]) for ownership checks.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::matrix::{self, Refusal};
use crate::principal::Principal;
use crate::transport::Security;

/// `tonic::transport::Server::builder().layer(AuthLayer::new(security))`.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    security: Arc<Security>,
}

impl AuthLayer {
    /// A layer that authenticates callers as `security` says.
    pub fn new(security: Security) -> Self {
        Self {
            security: Arc::new(security),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            security: self.security.clone(),
        }
    }
}

/// The service [`AuthLayer`] wraps around a server's routes.
#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    security: Arc<Security>,
}

/// What the caller of a request brought, as the layer sees it.
#[derive(Debug, Clone, Copy)]
pub struct Credentials<'a> {
    /// The `authorization` header.
    pub authorization: Option<&'a str>,
    /// The leaf client certificate of a TLS connection, DER.
    pub certificate: Option<&'a [u8]>,
    /// The peer's address.
    pub peer: Option<SocketAddr>,
}

/// The caller of a request on a server secured by `security`, or why it has none (the
/// UNAUTHENTICATED message). A bearer token wins over a certificate (a gateway may present
/// both: its certificate secures the connection, the token names its caller); without
/// either, only a plaintext server without a token file names a loopback caller
/// [`anonymous`](Principal::anonymous).
pub fn identify(security: &Security, creds: Credentials<'_>) -> Result<Principal, String> {
    if let Some(value) = creds.authorization {
        let Some(token) = value.strip_prefix("Bearer ") else {
            return Err("authorization metadata is not `Bearer TOKEN`".into());
        };
        let Some(tokens) = security.tokens() else {
            return Err("this server takes no bearer tokens (no --token-file)".into());
        };
        return tokens
            .get(token.trim())
            .cloned()
            .ok_or_else(|| "unknown bearer token".to_string());
    }
    if let Some(der) = creds.certificate {
        return Principal::from_certificate(der)
            .ok_or_else(|| "client certificate names no valid principal".to_string());
    }
    if security.is_plaintext()
        && security.tokens().is_none()
        && creds.peer.is_some_and(|p| p.ip().is_loopback())
    {
        return Ok(Principal::anonymous());
    }
    Err(if security.is_plaintext() {
        "no bearer token (plaintext callers off loopback need one)".into()
    } else {
        "no client certificate or bearer token".into()
    })
}

/// The principal the layer found for `request`. Every served call has one; a service called
/// without the layer (a unit test calling a handler) gets `None`.
pub fn principal_of<T>(request: &tonic::Request<T>) -> Option<&Principal> {
    request.extensions().get::<Principal>()
}

/// The status a call gets, or the caller it is allowed for.
pub fn authorize(
    security: &Security,
    path: &str,
    creds: Credentials<'_>,
) -> Result<Principal, tonic::Status> {
    let principal = identify(security, creds).map_err(|why| {
        // One client can make these as fast as it can send: logged at most once a
        // second, with the count left out (issue 29, point 9: 1.5 MB/s of logs).
        if let Some(suppressed) = UNAUTHENTICATED_LOG.allow(elapsed_ms()) {
            tracing::warn!(rpc = path, peer = ?creds.peer, why, suppressed, "call refused: unauthenticated");
        }
        tonic::Status::unauthenticated(format!("{path}: {why}"))
    })?;
    match matrix::check(path, principal.roles()) {
        Ok(()) => Ok(principal),
        Err(refusal) => {
            let message = match refusal {
                Refusal::NoRule => format!("{path} is not in the authorization matrix"),
                Refusal::Lacks(roles) => format!(
                    "{path} needs role {}; principal {} has roles {}",
                    matrix::role_list(roles),
                    principal.name(),
                    principal.roles()
                ),
            };
            tracing::warn!(
                rpc = path,
                principal = principal.name(),
                message,
                "call refused"
            );
            Err(tonic::Status::permission_denied(message))
        }
    }
}

/// Milliseconds since the first call of this process.
fn elapsed_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let ms = START.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
}

static UNAUTHENTICATED_LOG: LogLimit = LogLimit::new(1_000);

/// At most one log line per interval, shared by every thread: [`allow`](Self::allow) says
/// whether to log now and how many were left out since the last line.
#[derive(Debug)]
pub struct LogLimit {
    interval_ms: u64,
    /// When the last line was logged, plus one (0: never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    /// A limit of one line per `interval_ms`.
    pub const fn new(interval_ms: u64) -> Self {
        Self {
            interval_ms,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// At `now_ms`: `Some(left out since the last line)` when a line may be logged now,
    /// `None` (and one more left out) otherwise.
    pub fn allow(&self, now_ms: u64) -> Option<u64> {
        let last = self.last.load(Ordering::Acquire);
        let due = last == 0 || now_ms.saturating_sub(last - 1) >= self.interval_ms;
        if due
            && self
                .last
                .compare_exchange(last, now_ms + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::AcqRel));
        }
        self.suppressed.fetch_add(1, Ordering::AcqRel);
        None
    }
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for AuthService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    ResBody: Default + Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let tls = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
        let certs = tls.and_then(|t| t.peer_certs());
        let peer = match tls {
            Some(t) => t.get_ref().remote_addr(),
            None => request
                .extensions()
                .get::<TcpConnectInfo>()
                .and_then(|t| t.remote_addr()),
        };
        let creds = Credentials {
            authorization: request
                .headers()
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok()),
            certificate: certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref()),
            peer,
        };
        match authorize(&self.security, request.uri().path(), creds) {
            Ok(principal) => {
                request.extensions_mut().insert(principal);
                // The clone that was polled ready serves this call (tower's contract).
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(inner.call(request))
            }
            Err(status) => {
                let response = status.into_http::<ResBody>();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::{Role, Roles};
    use crate::tokens::Tokens;

    fn creds<'a>(
        authorization: Option<&'a str>,
        certificate: Option<&'a [u8]>,
        peer: &str,
    ) -> Credentials<'a> {
        Credentials {
            authorization,
            certificate,
            peer: peer.parse().ok(),
        }
    }

    #[test]
    fn plaintext_without_tokens_names_only_loopback_callers_anonymous() {
        let s = Security::loopback();
        let p = identify(&s, creds(None, None, "127.0.0.1:5")).unwrap();
        assert_eq!(p, Principal::anonymous());
        let e = identify(&Security::insecure(), creds(None, None, "10.0.0.1:5")).unwrap_err();
        assert!(e.contains("off loopback"), "{e}");
        let e = identify(&s, creds(Some("Bearer x"), None, "127.0.0.1:5")).unwrap_err();
        assert!(e.contains("no bearer tokens"), "{e}");
    }

    #[test]
    fn tokens_and_certificates_name_their_principal() {
        let tokens = Tokens::parse("0123456789abcdef bob client").unwrap();
        let s = Security::insecure().with_tokens(tokens);
        let bob = identify(
            &s,
            creds(Some("Bearer 0123456789abcdef"), None, "10.0.0.1:1"),
        )
        .unwrap();
        assert_eq!(bob.name(), "bob");
        // a token file ends anonymous access, also on loopback
        assert!(identify(&s, creds(None, None, "127.0.0.1:1")).is_err());
        assert!(identify(&s, creds(Some("Basic abc"), None, "127.0.0.1:1")).is_err());
        assert!(identify(&s, creds(Some("Bearer wrong"), None, "127.0.0.1:1")).is_err());

        let ca = crate::certs::Authority::new().unwrap();
        let cert = ca
            .client("sched", Roles::NONE.with(Role::Scheduler))
            .unwrap();
        let p = identify(&s, creds(None, Some(&cert.der), "10.0.0.1:1")).unwrap();
        assert_eq!(p.name(), "sched");
    }

    #[test]
    fn the_log_limit_lets_one_line_a_second_through_and_counts_the_rest() {
        let limit = LogLimit::new(1_000);
        assert_eq!(limit.allow(0), Some(0));
        for t in 1..1_000 {
            assert_eq!(limit.allow(t), None, "at {t} ms");
        }
        assert_eq!(limit.allow(1_000), Some(999));
        assert_eq!(limit.allow(1_500), None);
        assert_eq!(limit.allow(2_000), Some(1));
    }

    #[test]
    fn refusals_say_which_role_is_lacking() {
        let tokens = Tokens::parse("0123456789abcdef bob client,observer").unwrap();
        let s = Security::insecure().with_tokens(tokens);
        let bob = creds(Some("Bearer 0123456789abcdef"), None, "10.0.0.1:1");
        let e = authorize(&s, "/kvlease.v1.CacheService/Audit", bob).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            e.message(),
            "/kvlease.v1.CacheService/Audit needs role admin; principal bob has roles client,observer"
        );
        let e = authorize(
            &s,
            "/kvlease.v1.Scheduler/Generate",
            creds(None, None, "10.0.0.1:1"),
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(authorize(&s, "/kvlease.v1.Scheduler/Generate", bob).is_ok());
    }
}
