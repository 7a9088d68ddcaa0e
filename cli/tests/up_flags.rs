//! Flags of `kvlease up` that reach the services it starts, read from the
//! binary's own help.

use std::io::{BufRead as _, BufReader, Read as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `kvlease up`'s flags for one worker with every port free (no metrics).
const ONE_WORKER_ON_FREE_PORTS: [&str; 6] = [
    "--base-port",
    "0",
    "--metrics-base-port",
    "0",
    "--workers",
    "1",
];

fn up_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["up", "--help"])
        .output()
        .unwrap_or_else(|e| panic!("run kvlease: {e}"));
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The scheduler's step sampling is `kvlease up`'s too: the flag, and the
/// variable the standalone scheduler reads (which `up` used to ignore).
#[test]
fn up_takes_the_step_trace_sampling() {
    let help = up_help();
    assert!(help.contains("--trace-steps-one-in"), "{help}");
    assert!(help.contains("KVLEASE_TRACE_STEPS_ONE_IN"), "{help}");
}

/// Issue 25, point 5: the capacity flags say what they do, and max_tokens
/// is limited by the context, which the help says.
#[test]
fn up_help_explains_policy_on_exhausted_and_the_max_tokens_limit() {
    let help = up_help();
    let flag = |name: &str| {
        let at = help
            .find(&format!("--{name} "))
            .unwrap_or_else(|| panic!("--{name} not in {help}"));
        let rest = &help[at..];
        let end = rest[2..].find("\n      --").map_or(rest.len(), |e| e + 2);
        rest[..end].to_string()
    };
    let policy = flag("policy");
    for needle in ["guaranteed-no-evict", "max-utilization", "static-batch"] {
        assert!(policy.contains(needle), "{policy}");
    }
    let on_exhausted = flag("on-exhausted");
    for needle in ["preempt", "reject"] {
        assert!(on_exhausted.contains(needle), "{on_exhausted}");
    }
    let max_tokens = flag("max-tokens");
    assert!(
        max_tokens.contains("prompt + max_tokens must fit in --max-context"),
        "{max_tokens}"
    );
    assert!(max_tokens.contains("[default: 0]"), "{max_tokens}");
}

/// Issue 25, point 5: a taken `--http-listen` port was reported only after
/// the whole cluster had started and warmed up. It fails before any service
/// starts now: `up` never says it is starting them.
#[test]
fn up_refuses_a_taken_http_port_before_starting_services() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let addr = taken
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["up", "--http-listen", &addr])
        .args(ONE_WORKER_ON_FREE_PORTS)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap_or_else(|e| panic!("run kvlease up: {e}"));
    drop(taken);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")),
        "{stderr}"
    );
    assert!(!stdout.contains("starting cache"), "{stdout}");
}

/// Runs `kvlease ARGS` to its end, or kills it after `within`: its exit code (`None`: killed)
/// and stderr.
fn run_within(args: &[&str], within: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run kvlease: {e}"));
    let deadline = Instant::now() + within;
    let code = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.code(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    (code, stderr)
}

/// Issue 29, finding 8: given a client's TLS flags, `up` started its services in plaintext
/// and then gave up waiting for them over TLS ("cache did not become ready" after 30 s). The
/// flags name a client's credentials: `up` refuses them at once and points at `--tls`.
#[test]
fn up_refuses_a_clients_tls_flags_at_once() {
    let dir = std::env::temp_dir().join(format!("kvlease-up-flags-{}", std::process::id()));
    kvlease_auth::certs::write_dir(&dir, &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let file = |name: &str| dir.join(name).display().to_string();
    let (cert, key, ca) = (file("admin.pem"), file("admin.key"), file("ca.pem"));
    let mut args = vec![
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-ca",
        &ca,
        "up",
    ];
    args.extend(ONE_WORKER_ON_FREE_PORTS);
    let (code, stderr) = run_within(&args, Duration::from_secs(20));
    std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("`kvlease up --tls`"), "{stderr}");
}

/// `kvlease up --tls` itself: the admin it writes reaches the scheduler over mTLS, a plaintext
/// client does not.
#[test]
fn up_tls_serves_its_admin_and_no_plaintext_client() {
    let dir = std::env::temp_dir().join(format!("kvlease-up-tls-{}", std::process::id()));
    let tls_dir = dir.display().to_string();
    let mut up = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["up", "--tls", "--tls-dir", &tls_dir])
        .args(ONE_WORKER_ON_FREE_PORTS)
        .args(["--memory-budget-mib", "32"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("run kvlease up: {e}"));
    // the scheduler's address from the lines `up` prints once it serves
    let stdout = up.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    let (lines, printed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut scheduler = None;
    let mut seen = Vec::new();
    while let Ok(line) = printed.recv_timeout(Duration::from_secs(120)) {
        if let Some(addr) = line.trim().strip_prefix("scheduler") {
            scheduler = addr.split_whitespace().next().map(str::to_string);
        }
        let serving = line.starts_with("serving;");
        seen.push(line);
        if serving {
            break;
        }
    }
    let status = |tls: bool| {
        let mut args: Vec<String> = Vec::new();
        if tls {
            for (flag, file) in [
                ("--tls-cert", "admin.pem"),
                ("--tls-key", "admin.key"),
                ("--tls-ca", "ca.pem"),
            ] {
                args.push(flag.into());
                args.push(dir.join(file).display().to_string());
            }
        }
        args.push("status".into());
        args.push("--scheduler".into());
        args.push(scheduler.clone().unwrap_or_default());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run_within(&refs, Duration::from_secs(30))
    };
    let admin = status(true);
    let plaintext = status(false);
    let _ = up.kill();
    let _ = up.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(scheduler.is_some(), "no scheduler address in {seen:?}");
    assert!(
        seen.iter().any(|l| l.contains("admin.token")),
        "up does not say where the admin's token is: {seen:?}"
    );
    assert_eq!(admin.0, Some(0), "as admin: {}", admin.1);
    assert_eq!(plaintext.0, Some(1), "plaintext: {}", plaintext.1);
}
