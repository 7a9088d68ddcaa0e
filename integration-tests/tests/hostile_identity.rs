//! Issue 29, finding 6: every service certificate was valid for every service's host name and
//! peers checked only the CA and the host name, so a worker running with the gateway's key was
//! accepted by the scheduler and sent prompts. Now each service certificate names its service
//! (`kvlease://service/NAME`) and whoever dials a service refuses a certificate of another,
//! naming the service it expected and the one presented.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::secure::{certs, security_args};
use kvlease_integration_tests::{small_worker, start_cache, start_scheduler, start_worker};

/// How long the scheduler may take to start (or to give up).
const WITHIN: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_scheduler_refuses_a_worker_serving_with_the_gateways_certificate() {
    let cache = start_cache(cache_svc::Config {
        security: security_args("cache"),
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    // The gateway's certificate is of the same CA and valid for 127.0.0.1, as every
    // service certificate is: only the service it names tells it apart.
    let impostor = start_worker(worker_svc::Config {
        security: security_args("gateway"),
        owner: Some("scheduler".into()),
        ..small_worker()
    })
    .await
    .unwrap();
    let started = start_scheduler(
        scheduler_svc::Config {
            security: security_args("scheduler"),
            max_context: 256,
            max_tokens: 200,
            ..scheduler_svc::Config::default()
        },
        &cache.url(),
        &[impostor.url()],
        WITHIN,
    )
    .await;
    let e = match started {
        Ok(scheduler) => {
            // the old behaviour: the scheduler described the impostor, warmed up on it and
            // would send it every prompt
            scheduler.stop().await.unwrap();
            panic!("the scheduler accepted a worker serving with the gateway's certificate");
        }
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(
            "127.0.0.1 is not the worker: expected service worker (kvlease://service/worker), \
             presented service gateway (principal gateway)"
        ),
        "{e}"
    );
    impostor.stop().await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test]
async fn a_client_refuses_a_cache_where_it_dialed_a_scheduler() {
    // the process's client identity: `ops` (admin) of the same CA
    certs();
    let cache = start_cache(cache_svc::Config {
        security: security_args("cache"),
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    let addr = cache.addr.to_string();
    // the cache itself is fine to reach as the cache ...
    let mut client = kvlease::connect::cache(&addr).await.unwrap();
    kvlease::connect::stats(&mut client).await.unwrap();
    // ... but not as a scheduler: `kvlease generate` would send it prompts
    let e = kvlease::connect::scheduler(&addr)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("expected service scheduler (kvlease://service/scheduler), presented service cache (principal cache)"),
        "{e}"
    );
    cache.stop().await.unwrap();
}
