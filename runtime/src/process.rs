//! What the `main` of each service binary does, written once so the cache,
//! the scheduler, the worker and the gateway behave the same: flags parsed by clap (usage errors exit 64, help and
//! version exit 0), the configuration checked before anything starts (exit
//! 64), telemetry started, listeners bound (exit 64 when they cannot be),
//! then the service runs until SIGINT or SIGTERM. `main` returns the
//! [`ExitCode`] instead of calling `process::exit`, so the telemetry guard
//! flushes the spans of a failed start-up on the way out.

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;

use crate::serve::Listeners;

/// Exit code for usage and configuration errors (`EX_USAGE` of sysexits.h).
pub const EXIT_USAGE: u8 = 64;

/// The shutdown future a service binary hands to its `run`.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Parses the process's flags (with their environment fallbacks) into `C`.
/// Help and version print and give exit code 0; a usage error prints and
/// gives [`EXIT_USAGE`].
pub fn parse_args<C: clap::Parser>() -> Result<C, ExitCode> {
    C::try_parse().map_err(|e| {
        // Printing to a closed terminal is no reason to change the exit code.
        let _ = e.print();
        if e.use_stderr() {
            ExitCode::from(EXIT_USAGE)
        } else {
            ExitCode::SUCCESS
        }
    })
}

/// Parses `args` into `C` from the flags and their `default_value`s alone,
/// with every environment fallback ignored: what a configuration's `Default`
/// must equal, whatever the caller's shell exports.
pub fn parse_without_env<C, I, T>(name: &'static str, args: I) -> Result<C, clap::Error>
where
    C: clap::Args,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let command = C::augment_args(clap::Command::new(name)).mut_args(|arg| arg.env(None));
    let mut matches = command.try_get_matches_from(args)?;
    <C as clap::FromArgMatches>::from_arg_matches_mut(&mut matches)
}

/// Every argument of `command` and of its subcommands, at any depth, that
/// `--help` would show without a word of explanation, as `kvlease up
/// --policy`; and every subcommand without an about. Hidden arguments and
/// those clap adds itself (`--help`, `--version`) are exempt. For each
/// binary's test that its help explains every flag (issue 25, point 5).
pub fn missing_help(command: &clap::Command) -> Vec<String> {
    let mut command = command.clone();
    // adds --help and --version and propagates global arguments, so that
    // what is walked is what `--help` prints
    command.build();
    let mut missing = Vec::new();
    walk_help(&command, command.get_name(), &mut missing);
    missing
}

fn walk_help(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
    for arg in command.get_arguments() {
        let generated = matches!(
            arg.get_action(),
            clap::ArgAction::Help
                | clap::ArgAction::HelpShort
                | clap::ArgAction::HelpLong
                | clap::ArgAction::Version
        );
        let explained = arg
            .get_help()
            .or(arg.get_long_help())
            .is_some_and(|h| !h.to_string().trim().is_empty());
        if !generated && !arg.is_hide_set() && !explained {
            let name = match (arg.get_long(), arg.get_short()) {
                (Some(long), _) => format!("--{long}"),
                (None, Some(short)) => format!("-{short}"),
                (None, None) => arg.get_id().to_string().to_uppercase(),
            };
            missing.push(format!("{path} {name}"));
        }
    }
    for sub in command.get_subcommands() {
        // `help` is clap's own: it mirrors the others without abouts
        if sub.is_hide_set() || sub.get_name() == "help" {
            continue;
        }
        let sub_path = format!("{path} {}", sub.get_name());
        let about = sub.get_about().or(sub.get_long_about());
        if about.is_none_or(|a| a.to_string().trim().is_empty()) {
            missing.push(format!("{sub_path} (no about)"));
        }
        walk_help(sub, &sub_path, missing);
    }
}

/// Runs the binary at `bin` with `args` and an empty environment and
/// returns its exit code: for each service's test that its binary exits as
/// this module says.
pub fn exit_code_of(bin: &str, args: &[&str]) -> Option<i32> {
    let out = std::process::Command::new(bin)
        .args(args)
        .env_clear()
        .output();
    out.ok()?.status.code()
}

/// Resolves on the first SIGINT (Ctrl-C in a terminal) or SIGTERM (a
/// container stop). Where SIGTERM cannot be watched, on SIGINT alone; where
/// neither can, never (the process runs until killed).
pub async fn shutdown_signal() {
    let sigint = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    () = sigint => {}
                    _ = term.recv() => {}
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch SIGTERM; Ctrl-C only");
                sigint.await;
            }
        }
    }
    #[cfg(not(unix))]
    sigint.await;
    tracing::info!("shutdown signal received");
}

/// A service's `run` error: whether the configuration is at fault (exit 64)
/// or something else (exit 1).
pub trait RunError: Display {
    /// True when the configuration (flags, files it names, budgets) is at fault.
    fn is_config(&self) -> bool;
}

/// The addresses a service binary binds before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddrs {
    /// The main listener's address: gRPC (the gateway's: HTTP).
    pub grpc: SocketAddr,
    /// The Prometheus endpoint's address; none when off.
    pub metrics: Option<SocketAddr>,
}

impl ListenAddrs {
    /// The addresses of a configuration that passed (or failed, with its
    /// problem) its own checks.
    pub fn checked<E: Display>(
        checks: Result<(), E>,
        grpc: SocketAddr,
        metrics: Option<SocketAddr>,
    ) -> Result<Self, String> {
        checks.map_err(|e| e.to_string())?;
        Ok(Self { grpc, metrics })
    }
}

/// A service's configuration as its binary's `main` sees it.
pub trait ServiceConfig: clap::Parser {
    /// What the main listener serves, as a bind error names it.
    const LISTENER: &'static str = "grpc";

    /// Checks what can be checked before anything starts; where to listen.
    fn listen_addrs(&self) -> Result<ListenAddrs, String>;
}

/// The whole `main` of a service binary: parse the flags into `C`, check
/// them, start telemetry as `name`, bind, then `run` until SIGINT or
/// SIGTERM. Returns the exit code: 0 after a clean stop (or help),
/// [`EXIT_USAGE`] for a usage error, a bad configuration, an address that
/// cannot be bound or a configuration fault `run` found, 1 otherwise.
pub async fn main<C, E, Fut>(
    name: &'static str,
    run: impl FnOnce(Listeners, C, Shutdown) -> Fut,
) -> ExitCode
where
    C: ServiceConfig,
    Fut: Future<Output = Result<(), E>>,
    E: RunError,
{
    let config = match parse_args::<C>() {
        Ok(config) => config,
        Err(code) => return code,
    };
    let addrs = match config.listen_addrs() {
        Ok(addrs) => addrs,
        Err(problem) => {
            eprintln!("{name}: bad configuration: {problem}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // Dropped when this returns, which flushes the spans still buffered.
    let _telemetry = match kvlease_telemetry::init(name) {
        Ok(guard) => guard,
        Err(err) => {
            // RUST_LOG and OTEL_* are configuration too.
            eprintln!("{name}: {err}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let listeners = match Listeners::bind_named(C::LISTENER, addrs.grpc, addrs.metrics).await {
        Ok(listeners) => listeners,
        Err(err) => {
            tracing::error!(error = %err, "cannot start");
            eprintln!("{name}: {err}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match run(listeners, config, Box::pin(shutdown_signal())).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "service failed");
            eprintln!("{name}: {err}");
            if err.is_config() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{Arg, Command};

    use super::missing_help;

    #[test]
    fn missing_help_names_each_unexplained_argument_and_subcommand() {
        let command = Command::new("tool")
            .arg(Arg::new("a").long("a").help("explained"))
            .arg(Arg::new("b").long("b"))
            .arg(Arg::new("blank").long("blank").help("  "))
            .arg(Arg::new("hidden").long("hidden").hide(true))
            .arg(Arg::new("file"))
            .subcommand(Command::new("run").arg(Arg::new("c").short('c')))
            .subcommand(
                Command::new("ok")
                    .about("fine")
                    .arg(Arg::new("d").long("d").long_help("long only")),
            );
        assert_eq!(
            missing_help(&command),
            [
                "tool --b",
                "tool --blank",
                "tool FILE",
                "tool run (no about)",
                "tool run -c"
            ]
        );
    }
}
