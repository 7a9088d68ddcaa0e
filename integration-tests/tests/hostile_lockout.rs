//! Issue 29, finding 1: HTTP/2 connections that only answer PINGs, over TLS without a client
//! certificate, held every connection slot of a gRPC server for as long as the attacker
//! liked. Here a real cache over mTLS with a small connection cap: PING-only connections fill
//! it, and an authenticated client still gets in; a PING-only connection is closed at the
//! handshake deadline even though it answers every keepalive PING.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvlease_integration_tests::secure::{certs, channel_as, security_args};
use kvlease_integration_tests::start_cache;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_runtime::limits::ServeLimits;
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

/// A TLS client that trusts the test CA and presents no certificate.
fn anonymous_tls() -> tokio_rustls::TlsConnector {
    let ca = std::fs::read(certs().join("ca.pem")).unwrap();
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&ca) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// An HTTP/2 connection over TLS without a client certificate that never makes a call: h2's
/// connection task answers the server's PINGs and SETTINGS. The task ends when the server
/// closes the connection.
async fn pinger(addr: SocketAddr) -> JoinHandle<()> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let tls = anonymous_tls().connect(name, tcp).await.unwrap();
    let (send, connection) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(async move {
        let _keep = send;
        let _ = connection.await;
    })
}

/// A cache over mTLS under `limits`.
async fn cache(limits: ServeLimits) -> kvlease::cluster::Service {
    start_cache(cache_svc::Config {
        security: security_args("cache"),
        limits,
        ..cache_svc::Config::default()
    })
    .await
    .unwrap()
}

async fn stats_as_ops(addr: SocketAddr) -> Result<pb::GetStatsResponse, String> {
    let channel = channel_as(addr, Some("ops"))
        .await
        .map_err(|e| e.to_string())?;
    CacheServiceClient::new(channel)
        .get_stats(pb::GetStatsRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn ping_only_connections_do_not_lock_out_an_authenticated_client() {
    let cache = cache(ServeLimits {
        max_connections: 8,
        max_pending_handshakes: 8,
        // long enough that only eviction can make room during the test
        handshake_timeout_ms: 120_000,
        keepalive_interval_ms: 200,
        ..ServeLimits::default()
    })
    .await;
    let mut pingers = Vec::new();
    for _ in 0..8 {
        pingers.push(pinger(cache.addr).await);
    }
    // the PINGs flow: every connection is alive and has spoken
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(pingers.iter().all(|p| !p.is_finished()));

    let answered = tokio::time::timeout(Duration::from_secs(10), stats_as_ops(cache.addr))
        .await
        .expect("an authenticated client waited past 10 s");
    answered.expect("an authenticated client was locked out by PING-only connections");
    // it got in by evicting one of them
    tokio::time::sleep(Duration::from_millis(500)).await;
    let closed = pingers.iter().filter(|p| p.is_finished()).count();
    assert!(closed >= 1, "no PING-only connection was evicted");
    // and it keeps working while the rest stay
    stats_as_ops(cache.addr).await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test]
async fn a_ping_only_connection_is_closed_at_the_handshake_deadline() {
    let cache = cache(ServeLimits {
        handshake_timeout_ms: 1_000,
        keepalive_interval_ms: 100,
        keepalive_timeout_ms: 5_000,
        ..ServeLimits::default()
    })
    .await;
    let pinger = pinger(cache.addr).await;
    // It answers a PING every 100 ms, yet it made no authenticated call.
    tokio::time::timeout(Duration::from_secs(10), pinger)
        .await
        .expect("a PING-only connection outlived the 1 s handshake deadline by 9 s")
        .unwrap();
    // an authenticated client is unaffected
    stats_as_ops(cache.addr).await.unwrap();
    cache.stop().await.unwrap();
}
