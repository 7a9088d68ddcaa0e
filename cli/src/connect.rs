//! Connections to the services: endpoint parsing, clients, the health check.

use std::sync::OnceLock;
use std::time::Duration;

use kvlease_auth::{Security, ServiceKind};

use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::error::{Error, Result};

/// `host:port` or a URL; `http://` is added when no scheme is given.
pub fn url(addr: &str) -> String {
    let addr = addr.trim();
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// The transport security of this process's client calls: set once by `main` from
/// `--tls-cert`/`--tls-key`/`--tls-ca` (or their environment variables); plaintext without.
static SECURITY: OnceLock<Security> = OnceLock::new();

/// Sets the transport security of every later connection (first call wins).
pub fn set_security(security: Security) {
    let _ = SECURITY.set(security);
}

/// The transport security [`set_security`] gave (plaintext without).
pub fn security() -> Security {
    SECURITY.get().cloned().unwrap_or_default()
}

/// A channel to the service `expected` (`None`: any) at `addr` that connects within
/// `connect_timeout`: over mTLS (`https://`) when [`set_security`] gave TLS material.
pub async fn channel(
    addr: &str,
    expected: Option<ServiceKind>,
    connect_timeout: Duration,
) -> Result<Channel> {
    channel_as(&security(), addr, expected, connect_timeout).await
}

/// [`channel`] with the transport security `security`.
pub async fn channel_as(
    security: &Security,
    addr: &str,
    expected: Option<ServiceKind>,
    connect_timeout: Duration,
) -> Result<Channel> {
    let endpoint = security
        .endpoint(addr.trim(), expected)
        .map_err(|message| Error::Address {
            addr: addr.to_string(),
            message,
        })?;
    let url = endpoint.uri().to_string();
    endpoint
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| Error::Connect {
            addr: url,
            message: source_chain(&e),
        })
}

/// A scheduler client.
pub async fn scheduler(addr: &str) -> Result<SchedulerClient<Channel>> {
    Ok(SchedulerClient::new(
        channel(addr, Some(ServiceKind::Scheduler), Duration::from_secs(5)).await?,
    ))
}

/// A cache client.
pub async fn cache(addr: &str) -> Result<CacheServiceClient<Channel>> {
    Ok(CacheServiceClient::new(
        channel(addr, Some(ServiceKind::Cache), Duration::from_secs(5)).await?,
    ))
}

/// The scheduler's status.
pub async fn status(client: &mut SchedulerClient<Channel>) -> Result<pb::GetStatusResponse> {
    client
        .get_status(pb::GetStatusRequest {})
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| Error::rpc("GetStatus", s))
}

/// The cache's pool figures.
pub async fn stats(client: &mut CacheServiceClient<Channel>) -> Result<pb::GetStatsResponse> {
    client
        .get_stats(pb::GetStatsRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| Error::rpc("GetStats", s))
}

/// `grpc.health.v1.Health/Check` of `service` ("" = the whole server) at
/// `addr`, connection included, within `within`.
pub async fn health(addr: &str, service: &str, within: Duration) -> Result<ServingStatus> {
    health_as(&security(), addr, service, within).await
}

/// [`health`] with the transport security `security`.
pub async fn health_as(
    security: &Security,
    addr: &str,
    service: &str,
    within: Duration,
) -> Result<ServingStatus> {
    let check = async {
        let mut client = HealthClient::new(channel_as(security, addr, None, within).await?);
        let response = client
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .map_err(|s| Error::rpc("Health/Check", s))?;
        Ok(ServingStatus::try_from(response.into_inner().status).unwrap_or(ServingStatus::Unknown))
    };
    tokio::time::timeout(within, check)
        .await
        .map_err(|_| Error::Timeout {
            method: "Health/Check",
            within,
        })?
}

/// A transport error with its causes ("transport error: connection refused").
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        // transport errors often repeat their cause in their own message
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_adds_a_scheme_only_when_missing() {
        assert_eq!(url("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(url(" http://cache:50052 "), "http://cache:50052");
        assert_eq!(url("https://x:1"), "https://x:1");
    }

    #[tokio::test]
    async fn health_of_a_closed_port_is_an_error_not_a_hang() {
        // bind then drop: the port is very likely closed now
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(1);
        let r = health(&format!("127.0.0.1:{port}"), "", Duration::from_secs(2)).await;
        assert!(
            matches!(r, Err(Error::Connect { .. } | Error::Timeout { .. })),
            "{r:?}"
        );
    }
}
