//! The Debian package's files agree with the repository's (issue 49): the unit it installs
//! is `systemd/tollgate.service` with the binary at `/usr/bin/tollgate`, and the binary,
//! the unit and the config land where that unit looks for them. `packaging/deb.sh` builds
//! the package and checks it installed (CI runs it); these catch a drift without root.

const MANUAL_UNIT: &str = include_str!("../../systemd/tollgate.service");
const PACKAGED_UNIT: &str = include_str!("../../packaging/deb/tollgate.service");
const MANIFEST: &str = include_str!("../../Cargo.toml");

/// The unit from its `[Unit]` line on (the header comments differ: how each is installed).
fn body(unit: &str) -> &str {
    let at = unit.find("\n[Unit]\n").expect("a [Unit] section") + 1;
    &unit[at..]
}

#[test]
fn the_packaged_unit_is_the_manual_one_with_the_binary_in_usr_bin() {
    let expected = body(MANUAL_UNIT).replace("/usr/local/bin/tollgate", "/usr/bin/tollgate");
    assert!(
        body(PACKAGED_UNIT) == expected,
        "packaging/deb/tollgate.service is not systemd/tollgate.service with /usr/bin/tollgate: \
         run `bash packaging/deb.sh --sync-unit`"
    );
    assert!(!PACKAGED_UNIT.contains("/usr/local"));
    assert!(PACKAGED_UNIT
        .contains("\nExecStart=/usr/bin/tollgate run --config /etc/tollgate/tollgate.toml\n"));
}

/// `[package.metadata.deb]`'s `assets` as (source, destination, mode).
fn assets() -> Vec<(String, String, String)> {
    let manifest: toml::Value = toml::from_str(MANIFEST).unwrap();
    let assets = manifest["package"]["metadata"]["deb"]["assets"]
        .as_array()
        .expect("[package.metadata.deb] assets");
    assets
        .iter()
        .map(|a| {
            let a = a.as_array().expect("assets as [source, dest, mode]");
            let s = |i: usize| a[i].as_str().unwrap().to_string();
            (s(0), s(1), s(2))
        })
        .collect()
}

#[test]
fn the_package_puts_binary_unit_and_config_where_the_unit_looks() {
    let assets = assets();
    let dest = |source: &str| {
        let (_, dest, mode) = assets
            .iter()
            .find(|(s, _, _)| s == source)
            .unwrap_or_else(|| panic!("{source} is not an asset of the package"));
        (dest.as_str(), mode.as_str())
    };
    assert_eq!(dest("target/release/tollgate"), ("usr/bin/", "755"));
    assert_eq!(
        dest("packaging/deb/tollgate.service"),
        ("lib/systemd/system/tollgate.service", "644")
    );
    // Secrets: readable by root and (after the postinst) the tollgate group only.
    assert_eq!(
        dest("config/tollgate.toml"),
        ("etc/tollgate/tollgate.toml", "640")
    );
    for source in [
        "config/grafana/tollgate.json",
        "config/prometheus/alerts.yml",
        "README.md",
    ] {
        assert!(
            dest(source).0.starts_with("usr/share/doc/tollgate/"),
            "{source}"
        );
    }
    // Every source but the built binary is a file of the repository (a glob: a file of its
    // directory ending as the glob does).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (source, _, _) in assets.iter().filter(|(s, _, _)| !s.starts_with("target/")) {
        match source.split_once('*') {
            None => assert!(root.join(source).is_file(), "{source} does not exist"),
            Some((dir, suffix)) => {
                let found = std::fs::read_dir(root.join(dir))
                    .unwrap()
                    .filter_map(Result::ok)
                    .any(|e| e.file_name().to_string_lossy().ends_with(suffix));
                assert!(found, "{source} matches no file");
            }
        }
    }
    for script in ["postinst", "prerm", "postrm"] {
        let path = root.join("packaging/deb").join(script);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("#!/bin/sh\n"), "{script}");
        assert!(text.contains("\nset -e\n"), "{script}");
    }
}
