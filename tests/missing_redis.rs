//! Without redis-server, the Redis tests fail with a message that says how to get it (its
//! own test binary: it changes REDIS_SERVER for the whole process).

mod support;

use support::RedisServer;

#[test]
fn a_missing_redis_server_fails_with_how_to_install_it() {
    std::env::set_var("REDIS_SERVER", "/nonexistent/redis-server");
    let Err(panic) = std::panic::catch_unwind(RedisServer::start) else {
        panic!("redis-server must not start from a path that does not exist");
    };
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        message.contains("/nonexistent/redis-server")
            && message.contains("apt-get install redis-server")
            && message.contains("REDIS_SERVER="),
        "{message}"
    );
}
