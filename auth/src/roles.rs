//! The four roles and sets of them.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// What a principal may do; [`crate::matrix`] says which role each RPC needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Holds cache sessions, leases blocks and drives workers (`Forward`).
    Scheduler,
    /// Sends requests: `Generate`, the scheduler's `GetStatus`.
    Client,
    /// Reads figures: `GetStats`, `WatchEvents`, a worker's `Describe`.
    Observer,
    /// Operates the cluster: `RegisterPool`, `Audit`, closing others' sessions; may call
    /// everything (ownership checks still apply to the resources of others).
    Admin,
}

impl Role {
    /// Every role, in matrix order.
    pub const ALL: [Role; 4] = [Role::Scheduler, Role::Client, Role::Observer, Role::Admin];

    /// The role's name in token files, certificates and messages.
    pub fn name(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Client => "client",
            Role::Observer => "observer",
            Role::Admin => "admin",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| Error::UnknownRole(s.to_string()))
    }
}

/// A set of roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Roles(u8);

impl Roles {
    /// No role at all.
    pub const NONE: Roles = Roles(0);

    /// Every role.
    pub fn all() -> Self {
        Role::ALL.into_iter().collect()
    }

    /// Whether `role` is in the set.
    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    /// Whether the set grants `role`: it holds it, or holds `admin`.
    pub fn grants(self, role: Role) -> bool {
        self.contains(role) || self.contains(Role::Admin)
    }

    /// The set with `role` added.
    pub fn with(self, role: Role) -> Self {
        Roles(self.0 | role.bit())
    }

    /// The roles in the set, in matrix order.
    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// Parses `a,b,c`.
    pub fn parse_list(s: &str) -> Result<Self, Error> {
        s.split(',')
            .filter(|r| !r.is_empty())
            .map(str::parse::<Role>)
            .collect()
    }
}

impl FromIterator<Role> for Roles {
    fn from_iter<I: IntoIterator<Item = Role>>(iter: I) -> Self {
        iter.into_iter().fold(Roles::NONE, Roles::with)
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self.iter().map(Role::name).collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_lists_parse_and_print_and_unknown_roles_are_refused() {
        let roles = Roles::parse_list("client,observer").unwrap();
        assert!(roles.contains(Role::Client) && roles.contains(Role::Observer));
        assert!(!roles.grants(Role::Scheduler));
        assert_eq!(roles.to_string(), "client,observer");
        assert_eq!(Roles::NONE.to_string(), "none");
        let admin = Roles::parse_list("admin").unwrap();
        assert!(Role::ALL.into_iter().all(|r| admin.grants(r)));
        let err = Roles::parse_list("client,root").unwrap_err().to_string();
        assert!(err.contains("\"root\""), "{err}");
    }
}
