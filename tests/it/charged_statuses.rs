//! `routes.charged_statuses` (issue 48): only upstream responses with a listed status
//! are charged, while the check before forwarding still applies. A `/login` route that
//! charges 401 and 403 refuses a caller after N failed logins in a window, and
//! successful logins never count. Against the real gateway, a real upstream whose
//! answer the test picks per request (`/login?status=NNN`) and a real `redis-server`.

use crate::support::{
    self, capture_logs, get, log_lines, store_toml, Backend, RedisServer, TestGateway, Upstream,
};
use std::time::Duration;

/// A gateway on `store` whose route `/login` has `route_extra` and the limit `core`:
/// 5 units a minute for anonymous callers (the test's requests come from 127.0.0.1).
async fn start(store: &str, route_extra: &str) -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1m"
quota = {{ anonymous = 5 }}

[[routes]]
path_prefix = "/login"
upstream = "api"
limits = ["core"]
{route_extra}
"#,
        up = upstream.url()
    );
    let gw = TestGateway::start(&toml).await;
    (upstream, gw)
}

/// A login attempt on `path` that the upstream answers with `status`.
async fn login(gw: &TestGateway, path: &str, status: u16) -> support::client::Reply {
    get(&gw.url(&format!("{path}?status={status}"))).await
}

/// The `count` of the one window in `redis` (0 when there is none yet).
fn count_in(redis: &RedisServer) -> u64 {
    let keys = redis.keys();
    assert!(keys.len() <= 1, "one window: {keys:?}");
    keys.first().map_or(0, |k| {
        redis.cmd::<Option<u64>>(&["HGET", k, "count"]).unwrap_or(0)
    })
}

/// The issue's scenario on `gw` (5 failures a minute allowed): 4 failures, 10
/// successes, 1 failure, and the next attempt is refused with the limit's headers. With
/// `redis`, the window's count in Redis follows the failures only.
async fn four_failures_ten_successes_one_failure(
    gw: &TestGateway,
    path: &str,
    redis: Option<&RedisServer>,
) {
    for i in 1..=4u64 {
        let r = login(gw, path, 401).await;
        assert_eq!(r.status, 401, "failure {i} is the upstream's answer");
        assert_eq!(r.header("x-ratelimit-limit"), "5");
        assert_eq!(r.num("x-ratelimit-used"), i, "failure {i} is charged");
        assert_eq!(r.num("x-ratelimit-remaining"), 5 - i);
        if let Some(redis) = redis {
            assert_eq!(count_in(redis), i, "failure {i} counted in Redis");
        }
    }
    for i in 1..=10 {
        let r = login(gw, path, 200).await;
        assert_eq!(r.status, 200, "success {i} admitted");
        assert_eq!(r.num("x-ratelimit-used"), 4, "success {i} is never charged");
        assert_eq!(r.num("x-ratelimit-remaining"), 1);
        if let Some(redis) = redis {
            assert_eq!(count_in(redis), 4, "success {i} not counted in Redis");
        }
    }
    let r = login(gw, path, 401).await;
    assert_eq!(r.status, 401, "the fifth failure is still forwarded");
    assert_eq!(r.num("x-ratelimit-used"), 5);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    if let Some(redis) = redis {
        assert_eq!(count_in(redis), 5);
    }
    // The check before forwarding applies to every attempt, a would-be success too.
    let refused = login(gw, path, 200).await;
    assert_eq!(refused.status, 429, "five failures in the window: refused");
    assert_eq!(refused.header("x-ratelimit-limit"), "5");
    assert_eq!(refused.header("x-ratelimit-remaining"), "0");
    assert_eq!(refused.header("x-ratelimit-used"), "5");
    assert_eq!(refused.header("x-ratelimit-resource"), "core");
    assert!(refused.num("retry-after") >= 1);
    if let Some(redis) = redis {
        assert_eq!(count_in(redis), 5, "a refusal is not charged");
    }
}

/// The access lines of `path`, in order.
fn access_lines(path: &str) -> Vec<String> {
    log_lines(&["tollgate::access", &format!("path=\"{path}\"")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failed_logins_count_on_the_memory_store() {
    capture_logs();
    let store = store_toml(Backend::Memory, &[], "allow", "1s");
    let (upstream, gw) = start(&store, "charged_statuses = [401, 403]").await;
    let path = "/login/charged-memory";
    four_failures_ten_successes_one_failure(&gw, path, None).await;
    assert_eq!(
        upstream.hits(),
        15,
        "the refused attempt never reached the upstream"
    );
    // A 403 is charged too, once the window has passed.
    gw.clock.advance(Duration::from_secs(60));
    let r = login(&gw, path, 403).await;
    assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (403, 1));

    // The access log says which responses were charged and why the others were not.
    let lines = access_lines(path);
    assert_eq!(lines.len(), 17, "{lines:#?}");
    let charged = |l: &String| l.contains(" cost=1 ") && l.contains(" uncharged=\"-\" ");
    let not_charged = |l: &String| {
        l.contains(" cost=0 ") && l.contains(" uncharged=\"status_not_in_charged_statuses\" ")
    };
    for (i, line) in lines.iter().enumerate() {
        let status: u16 = match i {
            0..=3 | 14 => 401,
            4..=13 => 200,
            15 => 429,
            _ => 403,
        };
        assert!(
            line.contains(&format!(" status={status} ")),
            "line {i}: {line}"
        );
        match status {
            200 => assert!(not_charged(line), "line {i}: {line}"),
            429 => assert!(
                line.contains(" decision=\"rejected\" ")
                    && line.contains(" cost=0 ")
                    && line.contains(" uncharged=\"-\" ")
                    && line.contains(" remaining=0 "),
                "line {i}: {line}"
            ),
            _ => assert!(charged(line), "line {i}: {line}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failed_logins_count_in_redis() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "2s");
    let (_upstream, gw) = start(&store, "charged_statuses = [401, 403]").await;
    support::wait_connected(&gw).await;
    four_failures_ten_successes_one_failure(&gw, "/login/charged-redis", Some(&redis)).await;
}

/// With `charge = "on_request"` the attempt is reserved before it is forwarded; a
/// status that is not charged refunds the reservation, a charged one keeps it. Also on
/// the over-limit cache: a refusal remembered while the quota was reserved is
/// forgotten by the refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_request_refunds_what_is_not_charged() {
    capture_logs();
    let redis = RedisServer::start();
    for (backend, redis) in [(Backend::Memory, None), (Backend::Redis, Some(&redis))] {
        let store = match redis {
            None => store_toml(backend, &[], "deny", "2s"),
            Some(r) => store_toml(backend, &[r], "deny", "2s"),
        };
        let (_upstream, gw) = start(
            &store,
            "charge = \"on_request\"\ncharged_statuses = [401, 403]",
        )
        .await;
        if redis.is_some() {
            support::wait_connected(&gw).await;
        }
        let path = format!("/login/on-request-{backend:?}");
        // In Redis (count) and as the next check sees it (X-RateLimit-Used).
        let settles_at = async |used: u64| {
            if let Some(redis) = redis {
                support::wait_until(
                    Duration::from_secs(5),
                    &format!("{backend:?}: count {used} in Redis"),
                    || count_in(redis) == used,
                )
                .await;
            }
        };

        let ok = login(&gw, &path, 200).await;
        assert_eq!(ok.status, 200, "{backend:?}");
        assert_eq!(ok.num("x-ratelimit-used"), 0, "{backend:?}: 200 refunded");
        settles_at(0).await;
        let failed = login(&gw, &path, 401).await;
        assert_eq!(failed.status, 401);
        assert_eq!(failed.num("x-ratelimit-used"), 1, "{backend:?}: 401 kept");
        settles_at(1).await;
        for i in 2..=5u64 {
            assert_eq!(login(&gw, &path, 403).await.num("x-ratelimit-used"), i);
        }
        settles_at(5).await;
        let refused = login(&gw, &path, 200).await;
        assert_eq!(refused.status, 429, "{backend:?}: five failures reserved");
        assert_eq!(refused.header("x-ratelimit-remaining"), "0");
        settles_at(5).await;

        // A new window: successes, each reserved then refunded, never use it up.
        gw.clock.advance(Duration::from_secs(60));
        for i in 1..=8 {
            let r = login(&gw, &path, 200).await;
            assert_eq!(r.status, 200, "{backend:?}: success {i}");
            assert_eq!(r.num("x-ratelimit-used"), 0, "{backend:?}: success {i}");
        }
        let lines = access_lines(&path);
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.contains(" uncharged=\"status_not_in_charged_statuses\" "))
                .count(),
            9,
            "{backend:?}: {lines:#?}"
        );
    }
}

/// `304` is uncharged by default only while `uncharged_statuses` is the route's list:
/// with `charged_statuses` set, only its statuses are charged, whatever they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charged_statuses_replace_the_default_uncharged_304() {
    capture_logs();
    let store = store_toml(Backend::Memory, &[], "allow", "1s");
    let (_upstream, gw) = start(&store, "charged_statuses = [304]").await;
    let path = "/login/charged-304";
    assert_eq!(login(&gw, path, 304).await.num("x-ratelimit-used"), 1);
    assert_eq!(login(&gw, path, 401).await.num("x-ratelimit-used"), 1);
    let (_upstream, gw) = start(&store, "").await;
    let path = "/login/default-304";
    assert_eq!(login(&gw, path, 304).await.num("x-ratelimit-used"), 0);
    assert_eq!(login(&gw, path, 401).await.num("x-ratelimit-used"), 1);
    let lines = access_lines(path);
    assert!(
        lines[0].contains(" cost=0 ")
            && lines[0].contains(" uncharged=\"status_in_uncharged_statuses\" "),
        "{lines:#?}"
    );
}

/// `tollgate check`'s verdict on the file at `path`, in this process (the `tollgate`
/// binary in a build directory shared with other checkouts may be another build):
/// `Ok` when valid, else its error lines (`PATH:LINE:COLUMN: key.path: message`).
fn check(path: &std::path::Path) -> Result<(), Vec<String>> {
    let file = tollgate::config::read(path).map_err(|r| r.error_lines())?;
    let files = tollgate::load::Loaded::load(&file, None);
    tollgate::snapshot::Snapshot::build(&file, &files, None)
        .map(drop)
        .map_err(|r| r.error_lines())
}

#[test]
fn both_lists_on_one_route_and_statuses_out_of_range_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let head = "[[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9000\"]\n\n\
                [[routes]]\npath_prefix = \"/login\"\nupstream = \"api\"\n";
    let cases = [
        (
            "charged_statuses = [401, 403]\nuncharged_statuses = [304]\n",
            ":8:1: routes[0].charged_statuses: charged_statuses and uncharged_statuses cannot both be set on a route",
        ),
        (
            "charged_statuses = [401, 600]\n",
            ":8:26: routes[0].charged_statuses[1]: 600 is not an HTTP status (100-599)",
        ),
        (
            "charged_statuses = [99]\n",
            ":8:21: routes[0].charged_statuses[0]: 99 is not an HTTP status (100-599)",
        ),
        (
            "uncharged_statuses = [304, 1000]\n",
            ":8:28: routes[0].uncharged_statuses[1]: 1000 is not an HTTP status (100-599)",
        ),
    ];
    for (i, (route, expected)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("case{i}.toml"));
        std::fs::write(&path, format!("{head}{route}")).unwrap();
        let errors = check(&path).expect_err(route);
        let expected = format!("{}{expected}", path.display());
        assert!(
            errors.iter().any(|l| l.starts_with(&expected)),
            "case {i}: missing {expected:?} in:\n{errors:#?}"
        );
    }
    // Either list alone is fine.
    for (i, route) in [
        "charged_statuses = [401, 403]\n",
        "uncharged_statuses = [304, 404]\n",
    ]
    .iter()
    .enumerate()
    {
        let path = dir.path().join(format!("ok{i}.toml"));
        std::fs::write(&path, format!("{head}{route}")).unwrap();
        if let Err(errors) = check(&path) {
            panic!("{route}: {errors:#?}");
        }
    }
}

/// The example of docs/operations.md's "Stopping password guessing" is a valid config,
/// and its `/login` route charges 401 and 403 only.
#[test]
fn the_password_guessing_example_in_the_docs_is_valid() {
    let doc = std::fs::read_to_string("docs/operations.md").unwrap();
    let section = doc
        .split("## Stopping password guessing")
        .nth(1)
        .expect("the section");
    let example = section
        .split("```toml\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("a TOML example");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("login.toml");
    std::fs::write(&path, example).unwrap();
    if let Err(errors) = check(&path) {
        panic!("{errors:#?}");
    }
    let file = tollgate::config::read(&path).unwrap();
    let login = &file.config.routes[0];
    assert_eq!(login.path_prefix, "/login");
    assert_eq!(login.charged_statuses.as_deref(), Some(&[401, 403][..]));
    assert_eq!(login.uncharged_statuses, None);
}
