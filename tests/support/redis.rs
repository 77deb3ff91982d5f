//! Real `redis-server` processes on free loopback ports, stopped by PID.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The path of the program `name`: `$env_var` when set, else the first match on `PATH`
/// (and the usual system directories); `None` when it is nowhere.
pub fn find_bin(name: &str, env_var: &str) -> Option<String> {
    if let Ok(p) = std::env::var(env_var) {
        return Some(p);
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/bin", "/usr/sbin", "/usr/local/bin"])
        .map(|dir| std::path::Path::new(dir).join(name))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string());
    found
}

/// The path of `redis-server`, or a panic that says how to get it. Tests never skip.
pub fn redis_server_bin() -> String {
    find_bin("redis-server", "REDIS_SERVER").unwrap_or_else(|| {
        panic!("redis-server not found on PATH: these tests need a real Redis. Install it (Debian: apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server")
    })
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One `redis-server` on 127.0.0.1, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
    /// Working directory: replicas write the RDB they receive here, not in the repo.
    dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            dir: tempfile::tempdir().expect("temp dir for redis-server"),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(redis_server_bin());
        cmd.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args([
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ])
        .arg("--dir")
        .arg(self.dir.path())
        .args(&self.extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        self.child = Some(cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start {}: {e}. These tests need a real redis-server: install it (Debian: apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server", redis_server_bin())
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = self.conn() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// A plain synchronous connection for assertions.
    pub fn conn(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        client.get_connection_with_timeout(Duration::from_secs(1))
    }

    /// Run a command and return its reply.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.conn().expect("connect to test redis");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut c)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Every key, via SCAN.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.cmd(&["KEYS", "*"]);
        keys.sort();
        keys
    }

    /// Kill the process (SIGKILL) and wait for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port (empty: nothing is saved).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
