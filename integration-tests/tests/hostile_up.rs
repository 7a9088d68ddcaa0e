//! Issue 29, finding 8: `kvlease up` could not be secured (with TLS flags it served plaintext,
//! then gave up after 30 s), and on it every local user is an admin. `kvlease up --tls`
//! starts the cluster [`LocalTls`] sets up: every service serves mTLS only with its own
//! certificate, and only the credentials it writes into its private directory (the admin's
//! certificate or bearer token) make a caller an admin.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use kvlease::cluster::{Cluster, ClusterConfig};
use kvlease::local_tls::LocalTls;
use kvlease_auth::{Security, ServiceKind};
use kvlease_integration_tests::small_worker;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// A channel to `addr` as `security` says (connected lazily: the first call reports a failed
/// connection).
fn channel(security: &Security, addr: SocketAddr, service: ServiceKind) -> Channel {
    security
        .endpoint(&addr.to_string(), Some(service))
        .unwrap()
        .connect_lazy()
}

/// A TLS channel that trusts the cluster's CA and presents no certificate: a local user who
/// can read `ca.pem` (it is no secret) but not the admin's key.
fn no_certificate(tls: &LocalTls, addr: SocketAddr) -> Channel {
    let ca = std::fs::read(tls.dir().join("ca.pem")).unwrap();
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
        .unwrap()
        .connect_lazy()
}

/// Whether `status` is a connection the server would not hold: no gRPC answer at all, but a
/// transport error (a broken frame, a closed connection, a failed handshake: which one
/// depends on when the server hangs up), where an answer of the server has no source.
fn refused(status: &tonic::Status) -> bool {
    std::error::Error::source(status)
        .is_some_and(|e| e.downcast_ref::<tonic::transport::Error>().is_some())
}

async fn audit(channel: Channel, token: Option<&str>) -> Result<(), tonic::Status> {
    let mut request = tonic::Request::new(pb::AuditRequest::default());
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    CacheServiceClient::new(channel)
        .audit(request)
        .await
        .map(drop)
}

async fn status(channel: Channel) -> Result<(), tonic::Status> {
    SchedulerClient::new(channel)
        .get_status(pb::GetStatusRequest {})
        .await
        .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvlease_up_tls_serves_only_mtls_and_only_its_credentials_make_an_admin() {
    let dir = std::env::temp_dir().join(format!("kvlease-up-tls-it-{}", std::process::id()));
    let tls = LocalTls::create(&dir, &[]).unwrap();
    let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 1);
    config.worker = small_worker();
    config.scheduler.max_context = 256;
    config.scheduler.max_tokens = 200;
    config.ready_within = Duration::from_secs(60);
    tls.secure(&mut config);
    // The services start, find each other over mTLS by their own identities, and the cluster
    // checks their readiness without any principal's credentials but their own.
    let cluster = Cluster::start(config).await.unwrap();
    let admin = tls.client("admin").unwrap();

    // A plaintext client is refused: nothing is served without TLS (its HTTP/2 meets a TLS
    // alert, which it reads as a broken frame or a closed connection).
    let plain = status(channel(
        &Security::loopback(),
        cluster.scheduler,
        ServiceKind::Scheduler,
    ))
    .await
    .unwrap_err();
    assert!(refused(&plain), "{plain:?}");
    let plain = audit(
        channel(&Security::loopback(), cluster.cache, ServiceKind::Cache),
        None,
    )
    .await
    .unwrap_err();
    assert!(refused(&plain), "{plain:?}");

    // A local user without the credentials: not an admin, not even a caller.
    let e = audit(no_certificate(&tls, cluster.cache), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = status(no_certificate(&tls, cluster.scheduler))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = audit(
        no_certificate(&tls, cluster.cache),
        Some("0123456789abcdef-made-up"),
    )
    .await
    .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::Unauthenticated,
            "/kvlease.v1.CacheService/Audit: unknown bearer token"
        )
    );
    // nor with an admin certificate of a CA of their own making
    let own = dir.join("own-ca");
    kvlease_auth::certs::write_dir(&own, &[], &[]).unwrap();
    let forged = kvlease_auth::SecurityArgs {
        tls_cert: Some(own.join("admin.pem")),
        tls_key: Some(own.join("admin.key")),
        tls_ca: Some(dir.join("ca.pem")),
        ..kvlease_auth::SecurityArgs::default()
    }
    .load()
    .unwrap();
    let e = audit(channel(&forged, cluster.cache, ServiceKind::Cache), None)
        .await
        .unwrap_err();
    assert!(refused(&e), "{e:?}");
    // and the generated non-admin principals are not admins either
    let e = audit(
        channel(
            &tls.client("client").unwrap(),
            cluster.cache,
            ServiceKind::Cache,
        ),
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role admin"), "{e:?}");

    // The admin's certificate, and the admin's token over TLS, are an admin.
    audit(channel(&admin, cluster.cache, ServiceKind::Cache), None)
        .await
        .unwrap();
    let token = tls.admin_token().unwrap();
    audit(no_certificate(&tls, cluster.cache), Some(&token))
        .await
        .unwrap();
    status(channel(&admin, cluster.scheduler, ServiceKind::Scheduler))
        .await
        .unwrap();
    // and requests run through the services' own identities end to end
    let mut client =
        SchedulerClient::new(channel(&admin, cluster.scheduler, ServiceKind::Scheduler));
    let g = kvlease_integration_tests::collect(
        &mut client,
        pb::GenerateRequest {
            tokens: (3..40).collect(),
            max_tokens: 4,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{g:?}");

    cluster.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
