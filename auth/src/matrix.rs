//! The authorization matrix: for every RPC of every kvlease service, and for gRPC health and
//! reflection, which roles may call it. This table is the one place that decides; the
//! [`crate::layer`] applies it to every call before a service sees it, and the
//! integration tests walk it (every RPC x every role).
//!
//! `admin` may call everything (the matrix lists it only where it is the sole role). What a
//! principal may do to *resources* of others (someone else's session, a worker owned by
//! another principal) is not the matrix's business: the services check ownership.

use crate::roles::{Role, Roles};

/// Who may call one RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Any authenticated principal (health checks, reflection).
    Authenticated,
    /// A principal holding one of these roles (or `admin`).
    AnyOf(&'static [Role]),
}

use Role::{Admin, Client, Observer, Scheduler};

/// `(gRPC service, method, access)`; a method of a listed service that is not listed here is
/// refused, as is every method of a service not listed.
pub const MATRIX: &[(&str, &str, Access)] = &[
    // A scheduler registers the pools of its own worker groups at start-up; the cache binds a
    // group to the principal that registered it first.
    (
        "kvlease.v1.CacheService",
        "RegisterPool",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "OpenSession",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "KeepAlive",
        Access::AnyOf(&[Scheduler]),
    ),
    // Closing another principal's session takes `admin` (checked by the cache).
    (
        "kvlease.v1.CacheService",
        "CloseSession",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "Lease",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "Extend",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "Release",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "CompleteStep",
        Access::AnyOf(&[Scheduler]),
    ),
    // Release, CompleteStep and Extend of one step in one call.
    (
        "kvlease.v1.CacheService",
        "Step",
        Access::AnyOf(&[Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "Estimate",
        Access::AnyOf(&[Scheduler, Observer]),
    ),
    (
        "kvlease.v1.CacheService",
        "GetStats",
        Access::AnyOf(&[Observer, Scheduler]),
    ),
    (
        "kvlease.v1.CacheService",
        "WatchEvents",
        Access::AnyOf(&[Observer, Scheduler]),
    ),
    ("kvlease.v1.CacheService", "Audit", Access::AnyOf(&[Admin])),
    // Routing's read-only prefix lookup, in the caller's own session and groups (checked by
    // the cache): an observer could otherwise probe whether a prompt is cached.
    (
        "kvlease.v1.CacheService",
        "Match",
        Access::AnyOf(&[Scheduler]),
    ),
    // Dropping a whole pool group (nothing of it leased) is an operator's act.
    (
        "kvlease.v1.CacheService",
        "UnregisterPool",
        Access::AnyOf(&[Admin]),
    ),
    ("kvlease.v1.Scheduler", "Generate", Access::AnyOf(&[Client])),
    (
        "kvlease.v1.Scheduler",
        "GetStatus",
        Access::AnyOf(&[Client, Observer]),
    ),
    (
        "kvlease.v1.WorkerService",
        "Describe",
        Access::AnyOf(&[Scheduler, Observer]),
    ),
    // Also checked by the worker: only its owner's Forward is served.
    (
        "kvlease.v1.WorkerService",
        "Forward",
        Access::AnyOf(&[Scheduler]),
    ),
    // Peer pull: the worker decides (its owner, or a worker service
    // acting for its owner; see worker-svc's `PullBlocks`), as a worker
    // certificate holds no role.
    (
        "kvlease.v1.WorkerService",
        "PullBlocks",
        Access::Authenticated,
    ),
    (
        "kvlease.v1.WorkerService",
        "GetTokenizer",
        Access::AnyOf(&[Scheduler, Client, Observer]),
    ),
    ("grpc.health.v1.Health", "Check", Access::Authenticated),
    ("grpc.health.v1.Health", "Watch", Access::Authenticated),
    (
        "grpc.reflection.v1.ServerReflection",
        "ServerReflectionInfo",
        Access::Authenticated,
    ),
    (
        "grpc.reflection.v1alpha.ServerReflection",
        "ServerReflectionInfo",
        Access::Authenticated,
    ),
];

/// The access rule of the call at `path` (`/package.Service/Method`); `None` when the matrix
/// has no rule for it (refused).
pub fn access(path: &str) -> Option<Access> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    MATRIX
        .iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map(|(_, _, a)| *a)
}

/// Why the matrix refuses a caller holding `roles`: `None` when it may call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The RPC is not in the matrix.
    NoRule,
    /// The caller holds none of these roles.
    Lacks(&'static [Role]),
}

/// Whether `roles` may call the RPC at `path`.
pub fn check(path: &str, roles: Roles) -> Result<(), Refusal> {
    match access(path) {
        None => Err(Refusal::NoRule),
        Some(Access::Authenticated) => Ok(()),
        Some(Access::AnyOf(needed)) if needed.iter().any(|r| roles.grants(*r)) => Ok(()),
        Some(Access::AnyOf(needed)) => Err(Refusal::Lacks(needed)),
    }
}

/// `"scheduler"` or `"scheduler or observer"`: a refusal message's list of roles.
pub fn role_list(roles: &[Role]) -> String {
    let names: Vec<_> = roles.iter().map(|r| r.name()).collect();
    names.join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rpc_of_the_protos_has_exactly_one_rule() {
        let protos = [
            include_str!("../../proto/kvlease/v1/cache.proto"),
            include_str!("../../proto/kvlease/v1/scheduler.proto"),
            include_str!("../../proto/kvlease/v1/worker.proto"),
        ];
        let mut rpcs = 0;
        for proto in protos {
            let service = proto
                .lines()
                .find_map(|l| l.strip_prefix("service "))
                .and_then(|l| l.split_whitespace().next())
                .unwrap();
            for line in proto.lines().filter_map(|l| l.trim().strip_prefix("rpc ")) {
                let method = line.split('(').next().unwrap().trim();
                let path = format!("/kvlease.v1.{service}/{method}");
                let rules = MATRIX
                    .iter()
                    .filter(|(s, m, _)| *s == format!("kvlease.v1.{service}") && *m == method)
                    .count();
                assert_eq!(rules, 1, "{path}");
                rpcs += 1;
            }
        }
        assert_eq!(rpcs, 21);
    }

    #[test]
    fn roles_are_checked_and_admin_may_call_everything() {
        let client = Roles::NONE.with(Client);
        let lease = "/kvlease.v1.CacheService/Lease";
        assert_eq!(check(lease, client), Err(Refusal::Lacks(&[Scheduler])));
        assert_eq!(check(lease, Roles::NONE.with(Scheduler)), Ok(()));
        assert_eq!(check("/kvlease.v1.Scheduler/Generate", client), Ok(()));
        assert_eq!(
            check(
                "/kvlease.v1.CacheService/Audit",
                Roles::NONE.with(Scheduler)
            ),
            Err(Refusal::Lacks(&[Admin]))
        );
        let admin = Roles::NONE.with(Admin);
        assert!(
            MATRIX
                .iter()
                .all(|(s, m, _)| check(&format!("/{s}/{m}"), admin).is_ok())
        );
        assert_eq!(check("/grpc.health.v1.Health/Check", Roles::NONE), Ok(()));
        assert_eq!(
            check("/kvlease.v1.CacheService/Nope", admin),
            Err(Refusal::NoRule)
        );
        assert_eq!(check("garbage", admin), Err(Refusal::NoRule));
        assert_eq!(role_list(&[Scheduler, Observer]), "scheduler or observer");
    }
}
