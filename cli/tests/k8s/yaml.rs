//! YAML access: text, lists and maps out of parsed manifests.

use super::*;

pub fn text(y: &Yaml) -> Option<String> {
    match y {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Integer(i) => Some(i.to_string()),
        Yaml::Real(r) => Some(r.clone()),
        Yaml::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

pub fn items(y: &Yaml) -> &[Yaml] {
    y.as_vec().map(Vec::as_slice).unwrap_or_default()
}

pub fn strings(y: &Yaml) -> Vec<String> {
    items(y).iter().filter_map(text).collect()
}

/// A mapping of strings to strings (labels, annotations, selectors).
pub fn string_map(y: &Yaml) -> BTreeMap<String, String> {
    y.as_hash()
        .map(|h| {
            h.iter()
                .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
                .collect()
        })
        .unwrap_or_default()
}

/// `host:port` of a URL or a bare address.
pub fn host_port(addr: &str) -> Option<(String, u16)> {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    Some((host.to_string(), port.parse().ok()?))
}
