//! The loading step: every file a config names is read here, once, before its snapshot
//! is built, so that building (`Snapshot::build`, in src/snapshot.rs) does no file I/O.
//!
//! [`named`] lists the files (one place to see them all), each with the key that names
//! it and the path it is read from, resolved as the config's rules say: against the
//! config file's directory (`.` for a bare file name), except that the `[[upstreams]]`
//! PEM files are joined to the directory as written (`""` for a bare file name, so their
//! errors name `ca.pem` rather than `./ca.pem`), and that a secret file (`*_file`) is
//! looked up in `$CREDENTIALS_DIRECTORY` first ([`super::secrets::secret_path`]).
//! `Loaded::load` (src/load.rs) reads them into a [`Files`]: each file's bytes, or the error that
//! kept them, by key. The builders look a file up by its key and report a read error
//! at that key, in the words they used when they read the file themselves.
//!
//! Two things are read here that are not held as bytes: the keys file
//! (`identity.clients_file`), which can hold millions of keys, is read line by line
//! straight into its key set (`identity::read_keys`), because holding it whole
//! beside the set would add its size to the peak memory (124 MB for a million keys:
//! BENCHMARKS.md, "A million API keys"); and the operating system's trusted roots, when
//! a key asks for them (`upstreams.tls_roots` or `store.tls.roots` = `"system"`).

use super::secrets::secret_path;
use super::{
    Config, ConfigFile, IdentityConfig, Problems, StoreConfig, TlsConfig, TlsRoots, UpstreamConfig,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The key of the keys file, which `Loaded::load` (src/load.rs) reads into its key set.
pub const KEYS_FILE: &str = "identity.clients_file";

/// One file a config names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// The key that names it, e.g. `server.tls.cert`, `upstreams[2].ca`,
    /// `store.password_file`.
    pub key: String,
    /// Where it is read from (resolved; see the module documentation).
    pub path: PathBuf,
}

/// One file as the loading step read it.
#[derive(Debug)]
pub struct Loaded {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its bytes, or why they could not be read.
    pub bytes: std::io::Result<Vec<u8>>,
}

/// The files of one config, read: what building its snapshot takes instead of reading.
#[derive(Debug, Default)]
pub struct Files {
    /// Each file read whole, in the order of [`named`].
    read: Vec<(String, Loaded)>,
    /// Index into `read` by key.
    at: HashMap<String, usize>,
    /// The operating system's trusted roots, when some key asks for them.
    system_roots: Option<rustls_native_certs::CertificateResult>,
}

/// Every file `file` names, each at its key: `[server.tls]`'s, the PEM files of each
/// `[[upstreams]]` entry, `[identity]`'s (the keys file, then `[identity.jwt]`'s), then
/// `[store]`'s (its secret files, then `[store.tls]`'s).
pub fn named(file: &ConfigFile) -> Vec<Named> {
    let cfg = &file.config;
    let dir = base_dir(&file.path);
    let mut out = Vec::new();
    if let Some(tls) = &cfg.server.tls {
        out.extend(server_tls(tls, &dir));
    }
    // Joined to the directory as written: see the module documentation.
    let upstream_dir = file.path.parent().unwrap_or(Path::new(""));
    for (i, u) in cfg.upstreams.iter().enumerate() {
        out.extend(upstream(i, u, upstream_dir));
    }
    out.extend(identity(&cfg.identity, &dir));
    out.extend(store(&cfg.store, &dir));
    out.extend(tracing(&cfg.tracing, &dir));
    out
}

/// The files of `[tracing]`, relative to `dir`: each `headers_file` entry (a secret
/// file, at `tracing.headers_file.NAME`), then `ca`. None when tracing is off.
pub fn tracing(cfg: &crate::config::TracingConfig, dir: &Path) -> Vec<Named> {
    if !cfg.enabled {
        return Vec::new();
    }
    let mut out: Vec<Named> = cfg
        .headers_file
        .iter()
        .flat_map(|(name, f)| {
            secret(
                format!("tracing.headers_file.{name}"),
                &Some(f.clone()),
                dir,
            )
        })
        .collect();
    out.extend(cfg.ca.as_ref().map(|f| joined("tracing.ca".into(), f, dir)));
    out
}

/// The files of `[server.tls]`, relative to `dir`: `cert`, `key`, `ocsp`, each
/// `[[server.tls.sni]]` entry's `cert` and `key`, `ticket_keys`, `client_ca` (the order
/// of `Tls::digest`).
pub fn server_tls(tls: &TlsConfig, dir: &Path) -> Vec<Named> {
    let at = "server.tls";
    let mut out = vec![
        joined(format!("{at}.cert"), &tls.cert, dir),
        joined(format!("{at}.key"), &tls.key, dir),
    ];
    out.extend(
        tls.ocsp
            .as_ref()
            .map(|f| joined(format!("{at}.ocsp"), f, dir)),
    );
    for (i, sni) in tls.sni.iter().enumerate() {
        out.push(joined(format!("{at}.sni[{i}].cert"), &sni.cert, dir));
        out.push(joined(format!("{at}.sni[{i}].key"), &sni.key, dir));
    }
    let rest = [
        ("ticket_keys", &tls.ticket_keys),
        ("client_ca", &tls.client_ca),
    ];
    out.extend(
        rest.into_iter()
            .filter_map(|(key, f)| f.as_ref().map(|f| joined(format!("{at}.{key}"), f, dir))),
    );
    out
}

/// The PEM files of `upstreams[index]` (`ca`, `client_cert`, `client_key`), relative
/// to `dir`.
pub fn upstream(index: usize, cfg: &UpstreamConfig, dir: &Path) -> Vec<Named> {
    let at = format!("upstreams[{index}]");
    [
        ("ca", &cfg.ca),
        ("client_cert", &cfg.client_cert),
        ("client_key", &cfg.client_key),
    ]
    .into_iter()
    .filter_map(|(key, f)| f.as_ref().map(|f| joined(format!("{at}.{key}"), f, dir)))
    .collect()
}

/// The files of `[identity]`, relative to `dir`: the keys file ([`KEYS_FILE`]), then
/// `[identity.jwt]`'s `secret_file` (a secret file), `public_key` and `jwks`.
pub fn identity(cfg: &IdentityConfig, dir: &Path) -> Vec<Named> {
    let mut out: Vec<Named> = cfg
        .clients_file
        .as_ref()
        .map(|f| joined(KEYS_FILE.into(), f, dir))
        .into_iter()
        .collect();
    if let Some(jwt) = &cfg.jwt {
        let at = "identity.jwt";
        out.extend(secret(format!("{at}.secret_file"), &jwt.secret_file, dir));
        out.extend(
            jwt.public_key
                .as_ref()
                .map(|f| joined(format!("{at}.public_key"), f, dir)),
        );
        out.extend(
            jwt.jwks
                .as_ref()
                .map(|f| joined(format!("{at}.jwks"), f, dir)),
        );
    }
    out
}

/// The files of `[store]`, relative to `dir`: the secret files (`password_file`,
/// `sentinel_password_file`, `hash_key_file`), then `[store.tls]`'s `ca`, `client_cert`
/// and `client_key`.
pub fn store(cfg: &StoreConfig, dir: &Path) -> Vec<Named> {
    let mut out = Vec::new();
    out.extend(secret(
        "store.password_file".into(),
        &cfg.password_file,
        dir,
    ));
    out.extend(secret(
        "store.sentinel_password_file".into(),
        &cfg.sentinel_password_file,
        dir,
    ));
    out.extend(secret(
        "store.hash_key_file".into(),
        &cfg.hash_key_file,
        dir,
    ));
    if let Some(tls) = &cfg.tls {
        for (key, f) in [
            ("ca", &tls.ca),
            ("client_cert", &tls.client_cert),
            ("client_key", &tls.client_key),
        ] {
            out.extend(
                f.as_ref()
                    .map(|f| joined(format!("store.tls.{key}"), f, dir)),
            );
        }
    }
    out
}

/// Whether some key of `cfg` asks for the operating system's trusted roots.
pub fn wants_system_roots(cfg: &Config) -> bool {
    cfg.upstreams
        .iter()
        .any(|u| u.tls_roots == TlsRoots::System)
        || store_wants_system_roots(&cfg.store)
}

/// Whether `[store.tls]` asks for the operating system's trusted roots.
pub fn store_wants_system_roots(cfg: &StoreConfig) -> bool {
    cfg.tls
        .as_ref()
        .is_some_and(|t| t.roots == TlsRoots::System)
}

fn joined(key: String, file: &str, dir: &Path) -> Named {
    Named {
        key,
        path: dir.join(file),
    }
}

fn secret(key: String, file: &Option<String>, dir: &Path) -> Option<Named> {
    let path = secret_path(file.as_deref()?, dir);
    Some(Named { key, path })
}

impl Files {
    /// Read each of `named` whole (not the keys file: see `Loaded::load` (src/load.rs)).
    pub fn read(named: impl IntoIterator<Item = Named>) -> Files {
        let mut files = Files::default();
        for Named { key, path } in named {
            if key == KEYS_FILE || files.at.contains_key(&key) {
                continue;
            }
            let bytes = std::fs::read(&path);
            files.at.insert(key.clone(), files.read.len());
            files.read.push((key, Loaded { path, bytes }));
        }
        files
    }

    /// These files with the operating system's trusted roots, read now.
    pub fn with_system_roots(mut self) -> Files {
        self.system_roots = Some(rustls_native_certs::load_native_certs());
        self
    }

    /// The file named at `key`, as read; `None` when none was read there.
    pub fn get(&self, key: &str) -> Option<&Loaded> {
        self.at.get(key).map(|&i| &self.read[i].1)
    }

    /// The path and bytes of the file named at `key`. A problem at `key` when it could
    /// not be read (`cannot read PATH: ERROR`) or was never read.
    pub fn bytes(&self, key: &str, problems: &mut Problems) -> Option<(&Path, &[u8])> {
        self.bytes_or(key, problems, |path, e| {
            format!("cannot read {}: {e}", path.display())
        })
    }

    /// [`Files::bytes`], with the message for a file that could not be read made by
    /// `unreadable` from its path and the error.
    pub fn bytes_or(
        &self,
        key: &str,
        problems: &mut Problems,
        unreadable: impl FnOnce(&Path, &std::io::Error) -> String,
    ) -> Option<(&Path, &[u8])> {
        match self.get(key) {
            Some(Loaded {
                path,
                bytes: Ok(bytes),
            }) => Some((path, bytes)),
            Some(Loaded {
                path,
                bytes: Err(e),
            }) => {
                problems.error(key, unreadable(path, e));
                None
            }
            None => {
                not_read(key, problems);
                None
            }
        }
    }

    /// The operating system's trusted roots; a problem at `key` when they were not read.
    pub fn system_roots(
        &self,
        key: &str,
        problems: &mut Problems,
    ) -> Option<&rustls_native_certs::CertificateResult> {
        let roots = self.system_roots.as_ref();
        if roots.is_none() {
            not_read(key, problems);
        }
        roots
    }

    /// The contents of the files read at keys that start with `prefix`, in their order
    /// (each its bytes, or the error that kept them).
    pub fn contents_under<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = Result<&'a [u8], &'a std::io::Error>> + 'a {
        self.read
            .iter()
            .filter(move |(key, _)| key.starts_with(prefix))
            .map(|(_, f)| f.bytes.as_deref())
    }
}

/// The directory relative paths in a config file are resolved against (`.` for a bare
/// file name); also the directory a reload watches for a file.
pub fn base_dir(config_path: &Path) -> PathBuf {
    match config_path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The problem of a file a builder looked for that the loading step did not read: a
/// [`Files`] made for another config, or a file missing from [`named`].
fn not_read(key: &str, problems: &mut Problems) {
    problems.error(
        key,
        "was not read before the config was built (a bug: every file the config names is read first)",
    );
}

#[cfg(test)]
mod tests;
