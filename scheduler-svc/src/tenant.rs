//! Tenants: whose a `Generate` is, and the cache salt that keeps tenants' prefixes apart.
//!
//! A request's tenant is its caller's principal. A principal the operator names with
//! `--tenant-asserter` may instead name the tenant it acts for in the `kvlease-tenant`
//! metadata. (The HTTP gateway sends none: it keeps its callers apart by sending each bearer
//! token's principal as the request's `cache_salt`.) An operator may put
//! tenants in one group (`--tenant-group TENANT=GROUP`) so that they share prefixes. The cache
//! salt is HMAC-SHA256(server secret, group) (and the request's own `cache_salt`, which can only
//! partition a tenant's prefixes further): a tenant can neither reach another group's cached
//! blocks nor learn whether another tenant sent a prompt.

use std::collections::{HashMap, HashSet};

use kvlease_auth::Principal;
use kvlease_auth::principal::valid_name;
use kvlease_auth::salt::SaltKey;

use crate::error::{Error, Result};

/// The metadata key by which a tenant asserter names the tenant it acts for.
pub(crate) const TENANT_METADATA: &str = "kvlease-tenant";

/// The scheduler's tenancy rules.
#[derive(Debug, Clone)]
pub(crate) struct Tenancy {
    key: SaltKey,
    groups: HashMap<String, String>,
    asserters: HashSet<String>,
}

impl Tenancy {
    /// Rules with the salt key `key`, tenant `groups` (tenant, group) and the principals that
    /// may assert a tenant.
    pub(crate) fn new(key: SaltKey, groups: &[(String, String)], asserters: &[String]) -> Self {
        Self {
            key,
            groups: groups.iter().cloned().collect(),
            asserters: asserters.iter().cloned().collect(),
        }
    }

    /// The tenant of a request by `caller`, which named `asserted` (the `kvlease-tenant`
    /// metadata) or nothing. Naming a tenant takes `--tenant-asserter`; a name outside the safe
    /// set is refused.
    pub(crate) fn tenant_of(&self, caller: &Principal, asserted: Option<&str>) -> Result<String> {
        match asserted {
            None | Some("") => Ok(caller.name().to_string()),
            Some(_) if !self.asserters.contains(caller.name()) => {
                Err(Error::PermissionDenied(format!(
                    "principal {} may not name a tenant ({TENANT_METADATA}); the scheduler's \
                     --tenant-asserter lists who may",
                    caller.name()
                )))
            }
            Some(t) if !valid_name(t) => Err(Error::InvalidArgument(format!(
                "{TENANT_METADATA} {} must be 1 to 64 of [A-Za-z0-9._-]",
                kvlease_runtime::echo::clip(t, 64)
            ))),
            Some(t) => Ok(t.to_string()),
        }
    }

    /// The cache salt of `tenant`'s request that asked for `request_salt` (usually empty).
    pub(crate) fn salt(&self, tenant: &str, request_salt: &str) -> String {
        let group = self.groups.get(tenant).map_or(tenant, String::as_str);
        // A group name holds no newline, so `group\nsalt` is unambiguous.
        self.key.salt(&format!("{group}\n{request_salt}"))
    }
}

/// Parses `TENANT=GROUP`.
pub(crate) fn parse_tenant_group(s: &str) -> std::result::Result<(String, String), String> {
    let (tenant, group) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not TENANT=GROUP"))?;
    if !valid_name(tenant) || !valid_name(group) {
        return Err(format!(
            "{s:?}: tenant and group are 1 to 64 of [A-Za-z0-9._-]"
        ));
    }
    Ok((tenant.to_string(), group.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlease_auth::principal::Proof;
    use kvlease_auth::{Role, Roles};

    fn principal(name: &str) -> Principal {
        Principal::new(name, Roles::NONE.with(Role::Client), Proof::Token).unwrap()
    }

    #[test]
    fn tenants_come_from_the_principal_unless_an_asserter_names_one() {
        let t = Tenancy::new(SaltKey::new(b"k"), &[], &["gateway".into()]);
        assert_eq!(t.tenant_of(&principal("alice"), None).unwrap(), "alice");
        assert_eq!(t.tenant_of(&principal("alice"), Some("")).unwrap(), "alice");
        let e = t.tenant_of(&principal("alice"), Some("bob")).unwrap_err();
        assert!(e.to_string().contains("may not name a tenant"), "{e}");
        assert_eq!(
            t.tenant_of(&principal("gateway"), Some("bob")).unwrap(),
            "bob"
        );
        assert!(t.tenant_of(&principal("gateway"), Some("b\nob")).is_err());
        // a long name is quoted clipped, not whole
        let long = "x".repeat(10_000);
        let e = t.tenant_of(&principal("gateway"), Some(&long)).unwrap_err();
        let message = e.to_string();
        assert!(
            message.len() < 300 && message.contains("(10000 bytes)"),
            "{message}"
        );
    }

    #[test]
    fn salts_separate_tenants_unless_grouped() {
        let groups = [
            ("a".to_string(), "g".to_string()),
            ("b".to_string(), "g".to_string()),
        ];
        let t = Tenancy::new(SaltKey::new(b"k"), &groups, &[]);
        assert_eq!(t.salt("a", ""), t.salt("b", ""));
        assert_ne!(t.salt("a", ""), t.salt("c", ""));
        assert_ne!(t.salt("a", ""), t.salt("a", "x"));
        assert_ne!(
            t.salt("c", ""),
            Tenancy::new(SaltKey::new(b"other"), &[], &[]).salt("c", "")
        );
        assert_eq!(parse_tenant_group("a=g").unwrap(), ("a".into(), "g".into()));
        assert!(parse_tenant_group("a").is_err());
        assert!(parse_tenant_group("a=g g").is_err());
    }
}
