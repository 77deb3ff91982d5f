//! Unit tests of the TLS listener's certificates.

use super::*;

#[test]
fn subject_cn_reads_the_common_name() {
    let mut params = rcgen::CertificateParams::new(vec!["a.example".into()]).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "Org");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "client-7");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    assert_eq!(subject_cn(cert.der()).as_deref(), Some("client-7"));
    let mut params = rcgen::CertificateParams::new(vec!["a.example".into()]).unwrap();
    params.distinguished_name = rcgen::DistinguishedName::new();
    let cert = params.self_signed(&key).unwrap();
    assert_eq!(subject_cn(cert.der()), None);
}

#[test]
fn build_digest_is_the_files_digest() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["a.example".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let mut ca = rcgen::CertificateParams::new(vec![]).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&key).unwrap();
    std::fs::write(dir.path().join("a.pem"), cert.pem()).unwrap();
    std::fs::write(dir.path().join("a.key"), key.serialize_pem()).unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let absolute = dir.path().join("a.pem").display().to_string();
    let cfg = TlsConfig {
        cert: "a.pem".into(),
        key: "a.key".into(),
        sni: vec![crate::config::SniCertConfig {
            host: "b.example".into(),
            cert: absolute,
            key: "a.key".into(),
        }],
        handshake_timeout: crate::config::Dur::from_secs(10),
        client_ca: Some("ca.pem".into()),
        client_auth: None,
        ocsp: None,
        ticket_keys: None,
    };
    let mut problems = Problems::default();
    let files = Files::read(crate::config::files::server_tls(&cfg, dir.path()));
    let tls = Tls::build(&cfg, dir.path(), &files, &mut problems).expect("builds");
    assert!(problems.errors.is_empty(), "{:?}", problems.errors);
    assert_eq!(tls.files().len(), 5);
    assert_eq!(tls.digest(), files_digest(tls.files()));
    assert_eq!(tls.digest(), crate::tls::loaded_digest(&files));
}

#[test]
fn expiries_are_each_served_certificates_not_after() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, (y, m, d): (i32, u8, u8)| {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![format!("{name}.example")]).unwrap();
        params.not_after = rcgen::date_time_ymd(y, m, d);
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        cert.der().to_vec()
    };
    let a = write("a", (2031, 5, 17));
    write("b", (2029, 1, 2));
    // 2031-05-17T00:00:00Z and 2029-01-02T00:00:00Z.
    assert_eq!(not_after(&a), Some(1_936_742_400));
    let cfg = TlsConfig {
        cert: "a.pem".into(),
        key: "a.key".into(),
        sni: vec![crate::config::SniCertConfig {
            host: "B.Example".into(),
            cert: "b.pem".into(),
            key: "b.key".into(),
        }],
        handshake_timeout: crate::config::Dur::from_secs(10),
        client_ca: None,
        client_auth: None,
        ocsp: None,
        ticket_keys: None,
    };
    let mut problems = Problems::default();
    let files = Files::read(crate::config::files::server_tls(&cfg, dir.path()));
    let tls = Tls::build(&cfg, dir.path(), &files, &mut problems).expect("builds");
    let at = |f: &str| dir.path().join(f).display().to_string();
    assert_eq!(
        tls.expiries(),
        [
            CertExpiry {
                cert: at("a.pem"),
                sni: "default".into(),
                not_after: 1_936_742_400
            },
            CertExpiry {
                cert: at("b.pem"),
                sni: "b.example".into(),
                not_after: 1_862_006_400
            },
        ]
    );
    assert_eq!(not_after(b"not a certificate"), None);
    assert_eq!(not_after(&a[..a.len() / 2]), None);
}

#[test]
fn subject_cn_never_panics_on_garbage() {
    for bytes in [
        &[][..],
        &[0x30],
        &[0x30, 0x84, 0xff, 0xff, 0xff, 0xff],
        &[0x30, 0x02, 0x30, 0x05],
    ] {
        assert_eq!(subject_cn(bytes), None);
    }
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["a.example".into()]).unwrap();
    let der = params.self_signed(&key).unwrap().der().to_vec();
    for cut in 0..der.len() {
        let _ = subject_cn(&der[..cut]);
    }
}
