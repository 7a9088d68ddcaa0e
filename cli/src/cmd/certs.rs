//! `kvlease certs`: a development CA and certificates for mTLS.

use std::path::Path;
use std::process::ExitCode;

use kvlease_runtime::process::EXIT_USAGE;

use super::failed;

/// Runs `kvlease certs`: writes ca.pem, the services' certificates (valid
/// for `host` too) and those of the principals into `out`.
pub(crate) fn run(
    out: &Path,
    host: &[String],
    principal: &[(String, kvlease_auth::Roles)],
) -> ExitCode {
    match kvlease_auth::certs::write_dir(out, host, principal) {
        Ok(names) => {
            println!(
                "wrote {}/ca.pem and the certificate and key of: {}",
                out.display(),
                names.join(", ")
            );
            ExitCode::SUCCESS
        }
        Err(e @ kvlease_auth::Error::Config(_)) => {
            eprintln!("kvlease certs: {e}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => failed(e),
    }
}

/// `--principal NAME=ROLE[,ROLE]`.
pub(crate) fn parse_principal(s: &str) -> Result<(String, kvlease_auth::Roles), String> {
    let (name, roles) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=ROLE[,ROLE]"))?;
    let roles = kvlease_auth::Roles::parse_list(roles).map_err(|e| e.to_string())?;
    Ok((name.to_string(), roles))
}
