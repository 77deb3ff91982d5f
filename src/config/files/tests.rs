//! Unit tests of the loading step: what it lists, and that a snapshot built from what
//! it read touches no file.

use super::*;
use crate::limiter::store::AnyStore;

/// A config in `dir` that names a file at every kind of key: `[server.tls]` (with OCSP
/// and a client CA), an `https://` upstream's CA and client certificate, the keys file,
/// `[identity.jwt]`'s public key, and a Redis `[store]`'s secret files and `[store.tls]`
/// CA. The Redis store is built, never dialled.
fn config(dir: &Path) -> ConfigFile {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["a.example".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let mut ca = rcgen::CertificateParams::new(vec![]).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&key).unwrap();
    let key_line = format!(
        "{{\"id\": \"acme\", \"key_sha256\": \"{}\", \"tier\": \"gold\"}}\n",
        crate::snapshot::content_hash("acme-key")
    );
    for (name, text) in [
        ("a.pem", leaf.pem()),
        ("a.key", key.serialize_pem()),
        ("ca.pem", ca.pem()),
        ("ocsp.der", "an OCSP response".into()),
        ("jwt.pem", key.public_key_pem()),
        ("keys.jsonl", key_line),
        ("redis-password", "s3cret\n".into()),
        ("hash-key", "h4sh\n".into()),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let toml = "[server]\nlisten = \"127.0.0.1:0\"\n\
         [server.tls]\ncert = \"a.pem\"\nkey = \"a.key\"\nocsp = \"ocsp.der\"\nclient_ca = \"ca.pem\"\n\
         [store]\nbackend = \"redis\"\npassword_file = \"redis-password\"\nhash_key_file = \"hash-key\"\n\
         [[store.shards]]\nprimary = \"rediss://127.0.0.1:1\"\n\
         [store.tls]\nca = \"ca.pem\"\n\
         [identity]\nclients_file = \"keys.jsonl\"\n\
         [identity.jwt]\npublic_key = \"jwt.pem\"\nalgorithms = [\"ES256\"]\n\
         [[upstreams]]\nname = \"api\"\ntargets = [\"https://127.0.0.1:9\"]\nca = \"ca.pem\"\nclient_cert = \"a.pem\"\nclient_key = \"a.key\"\n\
         [[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { anonymous = 1, gold = 10 }\n\
         [[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"core\"]\n";
    crate::config::parse(&dir.join("tollgate.toml"), toml.into()).expect("config parses")
}

#[test]
fn every_file_the_config_names_is_listed_at_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = config(dir.path());
    let keys: Vec<String> = named(&file).into_iter().map(|n| n.key).collect();
    assert_eq!(
        keys,
        [
            "server.tls.cert",
            "server.tls.key",
            "server.tls.ocsp",
            "server.tls.client_ca",
            "upstreams[0].ca",
            "upstreams[0].client_cert",
            "upstreams[0].client_key",
            "identity.clients_file",
            "identity.jwt.public_key",
            "store.password_file",
            "store.hash_key_file",
            "store.tls.ca",
        ]
    );
    // A bare config file name: relative to ".", except the upstreams' PEM files,
    // joined to the directory as written (their errors name "ca.pem").
    let bare = ConfigFile {
        path: PathBuf::from("tollgate.toml"),
        ..file
    };
    let path_of = |key: &str| {
        named(&bare)
            .into_iter()
            .find(|n| n.key == key)
            .map(|n| n.path)
            .unwrap()
    };
    assert_eq!(path_of("server.tls.cert"), Path::new("./a.pem"));
    assert_eq!(path_of("upstreams[0].ca"), Path::new("ca.pem"));
    assert_eq!(path_of("identity.clients_file"), Path::new("./keys.jsonl"));
}

/// The point of the loading step: once it has read the files, building the snapshot
/// needs none of them. The directory is removed between the two, and the snapshot still
/// has the certificates, the keys of the keys file, the hash key and the Redis store; a
/// reload that keeps the key set does not look for the keys file either.
#[test]
fn a_snapshot_builds_from_loaded_files_with_every_file_gone() {
    let dir = tempfile::tempdir().unwrap();
    let file = config(dir.path());
    let files = crate::load::Loaded::load(&file, None);
    dir.close().unwrap();
    assert!(!file.path.exists());

    let snap = crate::snapshot::Snapshot::build(&file, &files, None)
        .unwrap_or_else(|r| panic!("builds without its files:\n{r}"));
    let tls = snap.tls.as_ref().expect("[server.tls] built");
    assert_eq!(tls.expiries().len(), 1);
    assert_eq!(tls.digest(), crate::tls::loaded_digest(&files.files));
    assert_eq!(snap.identities.keys().clients(), 1);
    assert_eq!(snap.hash_key_digest, crate::snapshot::content_hash("h4sh"));
    assert!(matches!(&**snap.limiter.store(), AnyStore::Redis(_)));

    let again = crate::load::Loaded::load(&file, Some(&snap.identities));
    assert!(again.keys.is_none(), "the kept key set's file is not read");
    let err = crate::snapshot::Snapshot::build(&file, &again, Some(&snap))
        .expect_err("the certificates are gone now");
    let lines = err.error_lines().join("\n");
    assert!(lines.contains("server.tls.cert: cannot read "), "{lines}");
    assert!(!lines.contains("identity.clients_file"), "{lines}");
}

/// A file that cannot be read is an error at the key that names it, naming the path,
/// in the words each builder used when it read the file itself.
#[test]
fn a_missing_file_is_an_error_at_its_key_naming_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = config(dir.path());
    for gone in ["a.key", "ca.pem", "keys.jsonl", "jwt.pem", "hash-key"] {
        std::fs::remove_file(dir.path().join(gone)).unwrap();
    }
    let files = crate::load::Loaded::load(&file, None);
    let err = crate::snapshot::Snapshot::build(&file, &files, None).expect_err("files missing");
    let lines = err.error_lines();
    let at = |f: &str| dir.path().join(f).display().to_string();
    let enoent = "No such file or directory (os error 2)";
    for want in [
        format!("server.tls.key: cannot read {}: {enoent}", at("a.key")),
        format!(
            "server.tls.client_ca: cannot read {}: {enoent}",
            at("ca.pem")
        ),
        format!("upstreams[0].ca: {}: I/O error: {enoent}", at("ca.pem")),
        format!(
            "upstreams[0].client_key: {}: I/O error: {enoent}",
            at("a.key")
        ),
        format!(
            "identity.clients_file: {}: cannot read the keys file: {enoent}",
            at("keys.jsonl")
        ),
        format!(
            "identity.jwt.public_key: cannot read {}: {enoent}",
            at("jwt.pem")
        ),
        format!(
            "store.hash_key_file: cannot read {}: {enoent}",
            at("hash-key")
        ),
        format!("store.tls.ca: {}: I/O error: {enoent}", at("ca.pem")),
    ] {
        assert!(
            lines.iter().any(|l| l.ends_with(&want)),
            "no line ends with {want:?}:\n{}",
            lines.join("\n")
        );
    }
}
