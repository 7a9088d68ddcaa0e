//! Bearer tokens, for gRPC clients without certificates: a token file of lines
//! `TOKEN PRINCIPAL ROLE[,ROLE]` (blank lines and `#` comments ignored).

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::principal::{Principal, Proof};
use crate::roles::Roles;

/// The principals of a token file, by token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens(HashMap<String, Principal>);

/// Tokens shorter than this are refused: a token is a password.
pub const MIN_TOKEN_LEN: usize = 16;

/// A fresh token: 32 bytes of the system's secure random generator, in hex.
pub fn generate() -> Result<String> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| Error::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl Tokens {
    /// Reads the token file at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            what: "token file",
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|(line, message)| Error::TokenFile {
            path: path.to_path_buf(),
            line,
            message,
        })
    }

    /// Parses a token file's text; the error is the 1-based line and what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut tokens = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<_> = line.split_whitespace().collect();
            let [token, name, roles] = fields[..] else {
                return Err((i + 1, "want `TOKEN PRINCIPAL ROLE[,ROLE]`".to_string()));
            };
            if token.len() < MIN_TOKEN_LEN {
                return Err((
                    i + 1,
                    format!("token shorter than {MIN_TOKEN_LEN} characters"),
                ));
            }
            let roles = Roles::parse_list(roles).map_err(|e| (i + 1, e.to_string()))?;
            let principal = Principal::new(name, roles, Proof::Token)
                .ok_or_else(|| (i + 1, format!("bad principal name {name:?}")))?;
            if tokens.insert(token.to_string(), principal).is_some() {
                return Err((i + 1, "token given twice".to_string()));
            }
        }
        Ok(Self(tokens))
    }

    /// The principal of `token`.
    pub fn get(&self, token: &str) -> Option<&Principal> {
        self.0.get(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::Role;

    #[test]
    fn token_files_parse_and_bad_lines_name_their_line() {
        let t = Tokens::parse("# ops\n\n0123456789abcdef  bob client,observer\n").unwrap();
        let bob = t.get("0123456789abcdef").unwrap();
        assert_eq!(bob.name(), "bob");
        assert!(bob.has(Role::Observer) && !bob.has(Role::Scheduler));
        assert!(t.get("nope").is_none());
        assert_eq!(Tokens::parse("x y").unwrap_err().0, 1);
        assert!(
            Tokens::parse("short bob client")
                .unwrap_err()
                .1
                .contains("shorter")
        );
        let e = Tokens::parse("\n0123456789abcdef bob root").unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains("root"));
        let e = Tokens::parse("0123456789abcdef b\tob client").unwrap_err();
        assert_eq!(e.0, 1);
        let twice = "0123456789abcdef a client\n0123456789abcdef b client";
        assert!(Tokens::parse(twice).unwrap_err().1.contains("twice"));
    }
}
