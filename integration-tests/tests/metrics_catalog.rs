#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failed test
//! What the services export, as their registries describe it, against what
//! people read: the metrics catalog of `docs/metrics.md` (every family, its type, service
//! and labels) and the Grafana dashboard (`deploy/grafana/kvlease.json`: its
//! shape, and that every PromQL query names exported series and labels).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use kvlease_telemetry::metrics::{Described, Kind};

/// One exported family and the services that register it.
#[derive(Debug, Clone)]
struct Exported {
    kind: Kind,
    labels: Vec<&'static str>,
    services: BTreeSet<&'static str>,
}

/// Every family the three services register, by name. A name two services
/// share must mean the same on both (kind and labels).
fn exported() -> BTreeMap<String, Exported> {
    let per_service: [(&str, Vec<Described>); 3] = [
        ("cache", cache_svc::metric_catalog().unwrap()),
        ("scheduler", scheduler_svc::metric_catalog().unwrap()),
        ("worker", worker_svc::metric_catalog().unwrap()),
    ];
    let mut all: BTreeMap<String, Exported> = BTreeMap::new();
    for (service, families) in per_service {
        assert!(!families.is_empty(), "{service} registers nothing");
        for d in families {
            let entry = all.entry(d.name.clone()).or_insert_with(|| Exported {
                kind: d.kind,
                labels: d.labels.clone(),
                services: BTreeSet::new(),
            });
            assert_eq!(
                (entry.kind, &entry.labels),
                (d.kind, &d.labels),
                "{} differs between services",
                d.name
            );
            entry.services.insert(service);
        }
    }
    all
}

/// Series name -> the labels its samples carry (histogram buckets add `le`).
fn series(exported: &BTreeMap<String, Exported>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for (name, e) in exported {
        let described = Described {
            name: name.clone(),
            kind: e.kind,
            help: String::new(),
            labels: e.labels.clone(),
        };
        for s in described.series() {
            let mut labels: BTreeSet<String> = e.labels.iter().map(|l| l.to_string()).collect();
            if s.ends_with("_bucket") {
                labels.insert("le".into());
            }
            out.insert(s, labels);
        }
    }
    out
}

fn repo_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

// === the catalog in docs/metrics.md ===

/// One row of the catalog table of `docs/metrics.md`.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    kind: String,
    services: BTreeSet<String>,
    labels: Vec<String>,
}

/// The rows of the table under `## Catalog`, by metric name.
fn catalog_rows(doc: &str) -> BTreeMap<String, Row> {
    let section = doc
        .split("\n## Catalog\n")
        .nth(1)
        .expect("docs/metrics.md has a `## Catalog` section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut rows = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `kvlease_")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells.len(), 5, "a row has 5 cells: {line}");
        let name = cells[0].trim_matches('`').to_string();
        let list = |cell: &str| -> Vec<String> {
            cell.split(',')
                .map(|s| s.trim().trim_matches('`').to_string())
                .filter(|s| !s.is_empty() && s != "-")
                .collect()
        };
        let row = Row {
            kind: cells[1].to_string(),
            services: list(cells[2]).into_iter().collect(),
            labels: list(cells[3]),
        };
        assert!(!cells[4].is_empty(), "{name} has no meaning");
        assert!(rows.insert(name.clone(), row).is_none(), "{name} twice");
    }
    rows
}

#[test]
fn the_catalog_documents_every_exported_metric() {
    let exported = exported();
    let rows = catalog_rows(&repo_file("docs/metrics.md"));
    let documented: BTreeSet<&String> = rows.keys().collect();
    let registered: BTreeSet<&String> = exported.keys().collect();
    assert_eq!(
        documented, registered,
        "docs/metrics.md catalog vs what the services register"
    );
    for (name, e) in &exported {
        let expected = Row {
            kind: e.kind.as_str().to_string(),
            services: e.services.iter().map(|s| s.to_string()).collect(),
            labels: e.labels.iter().map(|l| l.to_string()).collect(),
        };
        assert_eq!(rows[name], expected, "docs/metrics.md row of {name}");
    }
}

#[test]
fn catalog_rows_are_read_cell_by_cell() {
    let text = "x\n## Catalog\n\n| metric | type | service | labels | meaning |\n|---|---|---|---|---|\n\
        | `kvlease_a_total` | counter | cache, scheduler | `op`, `reason` | A. |\n\
        | `kvlease_b` | gauge | worker | - | B. |\n\n## Next\n| `kvlease_c` | gauge | x | - | C. |\n";
    let rows = catalog_rows(text);
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows["kvlease_a_total"].labels, vec!["op", "reason"]);
    assert_eq!(rows["kvlease_a_total"].services.len(), 2);
    assert!(rows["kvlease_b"].labels.is_empty());
}

// === PromQL ===

/// What one PromQL expression refers to: metric names (those starting with
/// `kvlease_`) with the label names of their selectors, and the label names
/// of `by (...)` / `without (...)` groupings.
#[derive(Debug, Default, PartialEq, Eq)]
struct Refs {
    selectors: Vec<(String, Vec<String>)>,
    grouping: Vec<String>,
}

fn promql_refs(expr: &str) -> Refs {
    let chars: Vec<char> = expr.chars().collect();
    let mut refs = Refs::default();
    let mut i = 0;
    let ident = |i: &mut usize| -> String {
        let start = *i;
        while *i < chars.len()
            && (chars[*i].is_ascii_alphanumeric() || chars[*i] == '_' || chars[*i] == ':')
        {
            *i += 1;
        }
        chars[start..*i].iter().collect()
    };
    let skip_string = |i: &mut usize| {
        let quote = chars[*i];
        *i += 1;
        while *i < chars.len() && chars[*i] != quote {
            if chars[*i] == '\\' {
                *i += 1;
            }
            *i += 1;
        }
        *i += 1;
    };
    // label names up to the closing `close`, skipping strings and values
    let label_list = |i: &mut usize, close: char| -> Vec<String> {
        let mut names = Vec::new();
        *i += 1;
        let mut expect_name = true;
        while *i < chars.len() && chars[*i] != close {
            let c = chars[*i];
            if c == '"' || c == '\'' || c == '`' {
                skip_string(i);
            } else if expect_name && (c.is_ascii_alphabetic() || c == '_') {
                names.push(ident(i));
                expect_name = false;
            } else {
                if c == ',' {
                    expect_name = true;
                }
                *i += 1;
            }
        }
        *i += 1;
        names
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            skip_string(&mut i);
        } else if c == '[' {
            // a range: `[5m]`, `[$__rate_interval]`
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '$' {
            i += 1;
            ident(&mut i);
        } else if c.is_ascii_alphabetic() || c == '_' {
            let word = ident(&mut i);
            let mut j = i;
            while j < chars.len() && chars[j] == ' ' {
                j += 1;
            }
            if word.starts_with("kvlease_") {
                let labels = if chars.get(i) == Some(&'{') {
                    label_list(&mut i, '}')
                } else {
                    Vec::new()
                };
                refs.selectors.push((word, labels));
            } else if (word == "by" || word == "without") && chars.get(j) == Some(&'(') {
                i = j;
                refs.grouping.extend(label_list(&mut i, ')'));
            }
        } else {
            i += 1;
        }
    }
    refs
}

#[test]
fn promql_references_are_found() {
    let refs = promql_refs(
        r#"sum by (op, reason) (rate(kvlease_rejects_total{job="kvlease-cache", reason=~"A|B"}[$__rate_interval])) / sum(kvlease_grants_total) + histogram_quantile(0.9, sum by (le) (rate(kvlease_x_bucket[5m])))"#,
    );
    assert_eq!(
        refs.selectors,
        vec![
            (
                "kvlease_rejects_total".to_string(),
                vec!["job".to_string(), "reason".to_string()]
            ),
            ("kvlease_grants_total".to_string(), vec![]),
            ("kvlease_x_bucket".to_string(), vec![]),
        ]
    );
    assert_eq!(refs.grouping, vec!["op", "reason", "le"]);
    // a name inside a string is not a reference
    assert!(
        promql_refs(r#"up{job="kvlease_cache"}"#)
            .selectors
            .is_empty()
    );
}

// === the dashboard ===

#[test]
fn the_dashboard_queries_only_exported_series_and_labels() {
    let series = series(&exported());
    let text = repo_file("deploy/grafana/kvlease.json");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    assert!(
        dash["title"].as_str().is_some_and(|t| !t.is_empty()),
        "title"
    );
    assert!(dash["uid"].as_str().is_some_and(|t| !t.is_empty()), "uid");
    assert!(
        dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion"
    );
    let panels = dash["panels"].as_array().expect("panels is a list");
    assert!(panels.len() >= 8, "{} panels", panels.len());
    // Prometheus adds these to every series; Grafana's histogram_quantile
    // groups by le.
    let scrape_labels = ["job", "instance"];
    let mut used = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("panel title");
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "{title}: id twice"
        );
        assert!(panel["type"].as_str().is_some(), "{title}: type");
        for key in ["x", "y", "w", "h"] {
            assert!(
                panel["gridPos"][key].as_u64().is_some(),
                "{title}: gridPos.{key}"
            );
        }
        assert_eq!(
            panel["datasource"]["type"], "prometheus",
            "{title}: datasource"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            assert!(
                ref_ids.insert(target["refId"].as_str().expect("refId")),
                "{title}: refId twice"
            );
            let expr = target["expr"].as_str().expect("expr");
            let refs = promql_refs(expr);
            assert!(
                !refs.selectors.is_empty(),
                "{title}: {expr} names no kvlease metric"
            );
            let mut labels_here: BTreeSet<String> =
                scrape_labels.iter().map(|l| l.to_string()).collect();
            for (name, selector_labels) in &refs.selectors {
                let known = series
                    .get(name)
                    .unwrap_or_else(|| panic!("{title}: {name} is not exported ({expr})"));
                for l in selector_labels {
                    assert!(
                        known.contains(l) || scrape_labels.contains(&l.as_str()),
                        "{title}: {name} has no label {l} ({expr})"
                    );
                }
                labels_here.extend(known.iter().cloned());
                used.insert(name.clone());
            }
            for l in &refs.grouping {
                assert!(
                    labels_here.contains(l),
                    "{title}: no series in {expr} has label {l}"
                );
            }
        }
    }
    // the panels the issue asks for are there
    for name in [
        "kvlease_pool_blocks",
        "kvlease_rejects_total",
        "kvlease_grants_total",
        "kvlease_time_to_first_token_seconds_bucket",
        "kvlease_request_duration_seconds_bucket",
        "kvlease_output_tokens_total",
        "kvlease_preemptions_total",
        "kvlease_reuse_hit_blocks_total",
    ] {
        assert!(used.contains(name), "no panel queries {name}");
    }
}
