//! The router against a linear scan of its routes, and its host and path matching.

use super::*;

#[test]
fn strips_ports() {
    assert_eq!(strip_port("api.example.com:8080"), "api.example.com");
    assert_eq!(strip_port("api.example.com"), "api.example.com");
    assert_eq!(strip_port("[::1]:80"), "[::1]");
}

/// The router before issue 46, kept as the reference: every route in the order of
/// [`Router::new`], the first that matches wins.
fn find_linear<'r>(
    routes: &'r [Arc<Route>],
    host: Option<&str>,
    path: &str,
    method: &http::Method,
) -> Option<&'r Arc<Route>> {
    let host = host.map(strip_port);
    routes.iter().find(|r| {
        r.matches(path, method)
            && r.host
                .as_deref()
                .is_none_or(|h| host.is_some_and(|req| req.eq_ignore_ascii_case(h)))
    })
}

/// One upstream to hang test routes on, from a real snapshot.
fn upstream() -> Arc<Upstream> {
    let toml = "[server]\nlisten = \"127.0.0.1:0\"\n\
                [[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9\"]\n\
                [[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\n";
    let file =
        crate::config::parse(std::path::Path::new("t.toml"), toml.into()).expect("config parses");
    let files = crate::load::Loaded::load(&file, None);
    let snap = crate::snapshot::Snapshot::build(&file, &files, None).expect("config is valid");
    snap.router.routes[0].upstream.clone()
}

fn route(
    upstream: &Arc<Upstream>,
    host: Option<&str>,
    prefix: &str,
    segments: bool,
    methods: &[http::Method],
) -> Arc<Route> {
    Arc::new(Route {
        host: host.map(str::to_owned),
        path_prefix: prefix.into(),
        segments,
        methods: methods.to_vec(),
        max_request_bytes: None,
        upstream: upstream.clone(),
        limits: LimitSet::new(Vec::new()),
        cost: 1,
        uncharged_statuses: Vec::new(),
        charged_statuses: None,
        on_request: false,
        upgrades: Vec::new(),
        trust_method_override: false,
    })
}

#[test]
fn longest_prefix_host_and_methods_order() {
    let up = upstream();
    let routes = vec![
        route(&up, None, "/", false, &[]),
        route(&up, None, "/api", true, &[]),
        route(&up, Some("a.example.com"), "/api", false, &[]),
        route(&up, None, "/api/v1", false, &[http::Method::POST]),
        route(&up, None, "/api/v1", false, &[]),
    ];
    let router = Router::new(routes.clone());
    let get = http::Method::GET;
    let post = http::Method::POST;
    let at = |host, path, m| router.find(host, path, m).map(Arc::as_ptr);
    let is = |i: usize| Some(Arc::as_ptr(&routes[i]));
    assert_eq!(
        at(None, "/apix", &get),
        is(0),
        "segments: /api does not match /apix"
    );
    assert_eq!(at(None, "/api/x", &get), is(1));
    assert_eq!(at(Some("A.Example.COM:8443"), "/apix", &get), is(2));
    assert_eq!(at(Some("b.example.com"), "/api", &get), is(1));
    assert_eq!(at(None, "/api/v1/x", &post), is(3));
    assert_eq!(at(None, "/api/v1/x", &get), is(4));
    assert_eq!(at(None, "/other", &get), is(0));
    assert!(Router::new(vec![routes[1].clone()])
        .find(None, "/", &get)
        .is_none());
}

#[test]
fn matches_a_linear_scan() {
    use proptest::prelude::*;
    let up = upstream();
    // Small alphabets, so that prefixes share bytes, nest, end in `/` or not.
    let piece = prop::sample::select(vec!["/", "a", "b", "/a", "/b", "ab", "é", "/ä/"]);
    let prefix = prop::collection::vec(piece.clone(), 0..4)
        .prop_map(|p| format!("/{}", p.concat()).replace("//", "/"));
    let host = prop::option::of(prop::sample::select(vec![
        "a.example.com",
        "b.example.com",
        "c",
    ]));
    let methods = prop::sample::subsequence(
        vec![http::Method::GET, http::Method::POST, http::Method::DELETE],
        0..=2,
    );
    let spec = (host, prefix, any::<bool>(), methods);
    let routes = prop::collection::vec(spec, 0..40);
    let path = prop::collection::vec(piece, 0..6).prop_map(|p| format!("/{}", p.concat()));
    let req_host = prop::option::of(prop::sample::select(vec![
        "a.example.com",
        "A.EXAMPLE.com:8080",
        "b.example.com",
        "c",
        "d",
        "[::1]:80",
    ]));
    let method = prop::sample::select(vec![
        http::Method::GET,
        http::Method::POST,
        http::Method::PUT,
    ]);
    let requests = prop::collection::vec((req_host, path, method), 1..30);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    });
    runner
        .run(&(routes, requests), |(specs, requests)| {
            let routes: Vec<Arc<Route>> = specs
                .iter()
                .map(|(h, p, seg, m)| route(&up, *h, p, *seg, m))
                .collect();
            let router = Router::new(routes);
            for (host, path, method) in &requests {
                let want = find_linear(&router.routes, *host, path, method).map(Arc::as_ptr);
                let got = router.find(*host, path, method).map(Arc::as_ptr);
                prop_assert_eq!(got, want, "{:?} {} {}", host, method, path);
            }
            Ok(())
        })
        .expect("the router agrees with a linear scan");
}

/// `uncharged_statuses` leaves out the statuses it lists; `charged_statuses`, when set,
/// charges only those it lists (the uncharged list is then empty), and the reason given
/// for the access log says which list decided.
#[test]
fn charged_statuses_charge_only_what_they_list() {
    use super::Uncharged;
    use http::StatusCode;
    let up = upstream();
    let mut r = Arc::try_unwrap(route(&up, None, "/login", false, &[])).unwrap();
    r.uncharged_statuses = vec![304];
    assert!(r.charges(StatusCode::OK) && r.charges(StatusCode::UNAUTHORIZED));
    assert_eq!(
        r.uncharged_by(StatusCode::NOT_MODIFIED),
        Some(Uncharged::StatusUncharged)
    );
    r.uncharged_statuses = Vec::new();
    r.charged_statuses = Some(vec![401, 403]);
    for s in [401, 403] {
        assert_eq!(
            r.uncharged_by(StatusCode::from_u16(s).unwrap()),
            None,
            "{s}"
        );
    }
    for s in [200, 204, 302, 304, 404, 500] {
        assert_eq!(
            r.uncharged_by(StatusCode::from_u16(s).unwrap()),
            Some(Uncharged::StatusNotCharged),
            "{s}"
        );
    }
    assert_eq!(
        Uncharged::StatusNotCharged.as_str(),
        "status_not_in_charged_statuses"
    );
}
