use super::*;
use crate::config::{ClientConfig, IdentityConfig, Problems};

fn ids() -> Identities {
    let cfg = IdentityConfig {
        clients: vec![ClientConfig {
            id: "acme".into(),
            key_sha256: hex::encode(Sha256::digest(b"sekrit")).into(),
            tier: "gold".into(),
        }],
        ..Default::default()
    };
    let mut p = Problems::default();
    let ids = Identities::build(&cfg, &mut p);
    assert!(p.is_ok());
    ids
}

fn headers(auth: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", auth.parse().unwrap());
    h
}

#[test]
fn bearer_and_token_schemes_find_the_client() {
    let ids = ids();
    let peer: IpAddr = "10.1.2.3".parse().unwrap();
    for v in ["Bearer sekrit", "token sekrit", "bearer  sekrit "] {
        let c = ids.identify(&headers(v), peer).unwrap();
        assert_eq!(c.label(), "acme");
        assert_eq!(&*c.tier, "gold");
    }
}

#[test]
fn unknown_key_is_bad_credentials_and_no_key_is_anonymous() {
    let ids = ids();
    let peer: IpAddr = "10.1.2.3".parse().unwrap();
    assert_eq!(
        ids.identify(&headers("Bearer nope"), peer).unwrap_err(),
        IdentityError::BadCredentials
    );
    assert_eq!(
        ids.identify(&headers("Bearer "), peer).unwrap_err(),
        IdentityError::BadCredentials
    );
    let anon = ids.identify(&HeaderMap::new(), peer).unwrap();
    assert_eq!(anon.label(), "10.1.2.3");
    assert_eq!(&*anon.tier, "anonymous");
    let basic = ids.identify(&headers("Basic dXNlcjpwYXNz"), peer).unwrap();
    assert!(basic.client.is_none());
}

#[test]
fn a_client_certificate_cn_names_the_client_only_when_enabled() {
    let peer: IpAddr = "10.1.2.3".parse().unwrap();
    // Off (the default): the CN is ignored.
    let c = ids()
        .identify_with_cert(&HeaderMap::new(), peer, Some("acme"))
        .unwrap();
    assert!(c.client.is_none());

    let cfg = IdentityConfig {
        client_cert_subject_as_caller: true,
        clients: vec![ClientConfig {
            id: "acme".into(),
            key_sha256: hex::encode(Sha256::digest(b"sekrit")).into(),
            tier: "gold".into(),
        }],
        ..Default::default()
    };
    let ids = Identities::build(&cfg, &mut Problems::default());
    let c = ids
        .identify_with_cert(&HeaderMap::new(), peer, Some("acme"))
        .unwrap();
    assert_eq!((c.label().as_str(), &*c.tier), ("acme", "gold"));
    let c = ids
        .identify_with_cert(&HeaderMap::new(), peer, Some("ACME"))
        .unwrap();
    assert!(c.client.is_none(), "ids are matched exactly");
    // A key decides, even an unknown one.
    assert_eq!(
        ids.identify_with_cert(&headers("Bearer nope"), peer, Some("acme"))
            .unwrap_err(),
        IdentityError::BadCredentials
    );
}

#[test]
fn bad_entries_are_reported() {
    let cfg = IdentityConfig {
        trusted_proxies: vec!["10.0.0.0/33".into()],
        clients: vec![ClientConfig {
            id: "a".into(),
            key_sha256: String::from("xyz").into(),
            tier: "t".into(),
        }],
        ..Default::default()
    };
    let mut p = Problems::default();
    Identities::build(&cfg, &mut p);
    let paths: Vec<_> = p.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "identity.trusted_proxies[0]",
            "identity.clients[0].key_sha256"
        ]
    );
}
