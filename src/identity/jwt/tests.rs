use super::*;

#[test]
fn jwt_shape() {
    assert!(looks_like_jwt(b"eyJh.eyJz.c2ln"));
    assert!(looks_like_jwt(b"eyJh.eyJz."));
    for not in [
        &b"sekrit"[..],
        b"a.b",
        b"a.b.c.d",
        b".b.c",
        b"a..c",
        b"a.b+.c",
        b"a.b.c=",
    ] {
        assert!(!looks_like_jwt(not), "{}", String::from_utf8_lossy(not));
    }
}

#[test]
fn config_errors_name_their_keys() {
    let cfg = JwtConfig {
        secret: None,
        secret_env: None,
        secret_file: None,
        public_key: Some("does-not-exist.pem".into()),
        jwks: None,
        algorithms: vec!["RS256".into(), "none".into(), "XX1".into()],
        leeway: crate::config::Dur::from_secs(30),
        issuer: None,
        audience: None,
        id_claim: "sub".into(),
        tier_claim: None,
        default_tier: "default".into(),
        tiers: vec![],
    };
    let mut p = Problems::default();
    let identity = crate::config::IdentityConfig {
        jwt: Some(cfg.clone()),
        ..Default::default()
    };
    let files = Files::read(crate::config::files::identity(
        &identity,
        std::path::Path::new("/nonexistent"),
    ));
    assert!(JwtVerifier::build(&cfg, &files, &mut p).is_none());
    let paths: Vec<_> = p.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "identity.jwt.algorithms[1]",
            "identity.jwt.algorithms[2]",
            "identity.jwt.public_key"
        ]
    );
    let none = JwtConfig {
        public_key: None,
        algorithms: vec![],
        ..cfg
    };
    let mut p = Problems::default();
    assert!(JwtVerifier::build(&none, &Files::default(), &mut p).is_none());
    let paths: Vec<_> = p.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["identity.jwt.algorithms", "identity.jwt"]);
}
