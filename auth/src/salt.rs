//! Tenant isolation of prefix reuse: the cache salt of a tenant is an HMAC of its name (or of
//! the name of the group an operator put it in) under a server secret, so a tenant can neither
//! share nor probe another tenant's cached prefixes, nor compute another tenant's salt.

use ring::hmac;

/// Derives cache salts from tenant names.
#[derive(Debug, Clone)]
pub struct SaltKey(hmac::Key);

impl SaltKey {
    /// A key from `secret` (any length; 32 random bytes are plenty).
    pub fn new(secret: &[u8]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// A fresh random key: salts then change on every restart, which costs only the cached
    /// prefixes (they are not found again after a restart anyway: the cache's epoch changes).
    pub fn random() -> Self {
        use ring::rand::SecureRandom as _;
        let mut secret = [0u8; 32];
        // The system RNG failing is not something a caller can cause; fall back to the time,
        // which still separates tenants (only unpredictability suffers), and say so.
        if ring::rand::SystemRandom::new().fill(&mut secret).is_err() {
            tracing::error!("system random number generator failed; tenant salts are predictable");
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            secret[..16].copy_from_slice(&now.to_le_bytes());
        }
        Self::new(&secret)
    }

    /// The cache salt of `tenant` (group): 32 hex digits of HMAC-SHA256(secret, tenant).
    pub fn salt(&self, tenant: &str) -> String {
        let tag = hmac::sign(&self.0, tenant.as_bytes());
        tag.as_ref()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_differ_by_tenant_and_by_secret_and_repeat_for_the_same_pair() {
        let k = SaltKey::new(b"secret");
        assert_eq!(k.salt("a"), k.salt("a"));
        assert_ne!(k.salt("a"), k.salt("b"));
        assert_ne!(k.salt("a"), SaltKey::new(b"other").salt("a"));
        assert_eq!(k.salt("a").len(), 32);
        assert_ne!(SaltKey::random().salt("a"), SaltKey::random().salt("a"));
    }
}
