//! Ownership of pool groups between principals, over real gRPC with bearer
//! tokens: a session leases, matches and registers only in its principal's
//! groups.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

mod common;

use common::*;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tonic::Code;
use tonic::transport::Channel;

/// Bearer tokens of the ownership test: two schedulers and an operator.
const TOKENS: &[(&str, &str, &str)] = &[
    ("token-of-scheduler-a", "sched-a", "scheduler"),
    ("token-of-scheduler-b", "sched-b", "scheduler"),
    ("token-of-the-operator", "ops", "admin"),
];

/// Adds one principal's bearer token to every call.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        r.metadata_mut().insert("authorization", self.0.clone());
        Ok(r)
    }
}

type Authed = CacheServiceClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// A client of the server at `addr` calling as principal `name` of [`TOKENS`].
async fn client_as(addr: std::net::SocketAddr, name: &str) -> Authed {
    let token = TOKENS.iter().find(|t| t.1 == name).unwrap().0;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let bearer = Bearer(format!("Bearer {token}").parse().unwrap());
    CacheServiceClient::with_interceptor(channel, bearer)
}

/// A group of one pool of 8 blocks of 4 tokens.
fn group_req(group: &str) -> pb::RegisterPoolRequest {
    register_req(group, 4, vec![pool_spec(0, 8)])
}

async fn open_as(c: &mut Authed, holder: &str) -> (u64, u64) {
    let r = c
        .open_session(pb::OpenSessionRequest {
            holder: holder.into(),
            ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    (r.session_id, r.epoch)
}

/// A session of one principal leases, matches and registers only in its
/// principal's groups (invariant 11): scheduler B (and an operator's own
/// session) asking for scheduler A's group gets PERMISSION_DENIED naming it,
/// with nothing taken and nothing learnt of A's cached prefix.
#[tokio::test]
async fn a_principals_session_may_use_only_its_principals_groups() {
    let dir = std::env::temp_dir().join(format!("kvlease-cache-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("tokens");
    let lines: Vec<String> = TOKENS
        .iter()
        .map(|(t, n, r)| format!("{t} {n} {r}"))
        .collect();
    std::fs::write(&token_file, lines.join("\n")).unwrap();
    let mut config = config();
    config.security.token_file = Some(token_file);
    let server = Server::start(config).await;
    let (mut a, mut b) = (
        client_as(server.addr, "sched-a").await,
        client_as(server.addr, "sched-b").await,
    );
    let mut ops = client_as(server.addr, "ops").await;

    // A's group with a cached prefix of two full blocks
    a.register_pool(group_req("m/a")).await.unwrap();
    let sa = open_as(&mut a, "a").await;
    let prompt: Vec<u32> = (40..49).collect();
    let out = a
        .lease(lease_req(sa, 1, vec![seq_in("m/a", 1, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    grant(&out.outcomes[0]);
    a.complete_step(complete_req(sa, 1)).await.unwrap();
    a.release(release_req(sa, vec![1], None)).await.unwrap();

    b.register_pool(group_req("m/b")).await.unwrap();
    let sb = open_as(&mut b, "b").await;
    let so = open_as(&mut ops, "ops").await;
    let before = ops
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let denied = "belongs to another principal";
    // B's Lease, a member of its own group first; the operator's session
    // (no group of its own) gets no override
    for (c, s, who, own) in [
        (&mut b, sb, "sched-b", Some("m/b")),
        (&mut ops, so, "ops", None),
    ] {
        let mut specs: Vec<_> = own
            .map(|g| seq_in(g, 7, prompt.clone()))
            .into_iter()
            .collect();
        specs.push(seq_in("m/a", 8, prompt.clone()));
        for atomic in [false, true] {
            let r = c
                .lease(pb::LeaseRequest {
                    atomic,
                    ..lease_req(s, 1, specs.clone())
                })
                .await;
            assert_status(
                r,
                Code::PermissionDenied,
                "pool group \"m/a\" belongs to another principal",
            );
        }
        let r = c
            .r#match(pb::MatchRequest {
                session_id: s.0,
                epoch: s.1,
                pool_groups: vec!["m/a".into()],
                prompts: vec![pb::MatchPrompt {
                    prompt_tokens: prompt.clone(),
                    cache_salt: String::new(),
                }],
            })
            .await;
        assert_status(r, Code::PermissionDenied, "pool group \"m/a\"");
        // registering A's group again, with its geometry or another
        let mut other = group_req("m/a");
        other.pools[0].num_blocks = 9;
        for req in [group_req("m/a"), other] {
            let r = c.register_pool(req).await;
            assert_status(
                r,
                Code::PermissionDenied,
                &format!("\"m/a\" {denied}; {who} may not use it"),
            );
        }
    }
    let after = ops
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before, after, "a refused call took or counted something");
    assert!(after.pools.iter().all(|p| p.in_use == 0 && p.fenced == 0));
    assert_eq!(after.sequences, 0);

    // A still leases in its group, reusing its prefix; B in its own
    let out = a
        .lease(lease_req(sa, 2, vec![seq_in("m/a", 8, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&out.outcomes[0]).reused_tokens, 8);
    let out = b
        .lease(lease_req(sb, 1, vec![seq_in("m/b", 7, prompt.clone())]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grant(&out.outcomes[0]).reused_tokens, 0);
    let again = a.register_pool(group_req("m/a")).await.unwrap();
    assert!(again.into_inner().already_registered);
    for (c, s) in [(&mut a, sa), (&mut b, sb), (&mut ops, so)] {
        c.close_session(close_req(s)).await.unwrap();
    }
    let audit = ops
        .audit(pb::AuditRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(audit.reclaimed.is_empty(), "{audit:?}");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
