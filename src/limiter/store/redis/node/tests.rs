use super::call::breaks_connection;

/// The error a node answers with `reply` (one RESP error line).
fn answered(reply: &str) -> redis::RedisError {
    match redis::parse_redis_value(format!("-{reply}\r\n").as_bytes()) {
        Ok(v) => v.extract_error().expect_err("an error reply"),
        Err(e) => e,
    }
}

/// Error replies from a live node are not a dead connection: no reconnect.
#[test]
fn error_replies_from_a_live_node_keep_the_connection() {
    for reply in [
        "LOADING Redis is loading the dataset in memory",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "CLUSTERDOWN The cluster is down",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "READONLY You can't write against a read only replica.",
        "MOVED 3999 127.0.0.1:6381",
        "ASK 3999 127.0.0.1:6381",
        "NOSCRIPT No matching script.",
        "ERR Error running script",
    ] {
        let e = answered(reply);
        assert!(e.code().is_some(), "{reply}: {e:?}");
        assert!(!breaks_connection(&e), "{reply} must not reconnect");
    }
    let dropped =
        redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    assert!(breaks_connection(&dropped));
}
