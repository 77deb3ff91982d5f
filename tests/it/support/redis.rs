//! Real `redis-server` processes on free loopback ports, stopped by PID.

use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
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

/// Run the command `args` (name first) on `c`.
pub fn query<T: redis::FromRedisValue>(
    c: &mut redis::Connection,
    args: &[&str],
) -> redis::RedisResult<T> {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(c)
}

/// `redis-server` on 127.0.0.1:`port` with the tests' settings (no persistence, no
/// daemon, quiet, working directory `dir`), then `extra`.
pub fn spawn_server(
    port: u16,
    dir: &std::path::Path,
    extra: &[impl AsRef<std::ffi::OsStr>],
) -> Process {
    let child = Command::new(redis_server_bin())
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--protected-mode", "no", "--loglevel", "warning"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start {}: {e}. These tests need a real redis-server: install it (Debian: apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server", redis_server_bin())
        });
    Process::new(child)
}

/// Write a Sentinel config in `dir` (port, bind, `dir`, then `body`) as
/// `sentinel-PORT.conf` and start `redis-server CONF --sentinel` on it; its path and
/// the process.
pub fn spawn_sentinel(
    dir: &std::path::Path,
    port: u16,
    body: &str,
) -> (std::path::PathBuf, Process) {
    let conf = dir.join(format!("sentinel-{port}.conf"));
    let text = format!(
        "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\nlogfile \"\"\nloglevel warning\ndir \"{}\"\n{body}",
        dir.display()
    );
    std::fs::write(&conf, text).expect("write sentinel conf");
    let child = Command::new(redis_server_bin())
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start {} --sentinel: {e}. These tests need a real redis-server: install it (Debian: apt-get install redis-server redis-tools) or set REDIS_SERVER=/path/to/redis-server", redis_server_bin())
        });
    (conf, Process::new(child))
}

/// A child process, killed (SIGKILL) and reaped when dropped or [`Process::kill`]ed.
#[derive(Default)]
pub struct Process(Option<Child>);

impl Process {
    pub fn new(child: Child) -> Process {
        Process(Some(child))
    }

    pub fn pid(&self) -> Option<u32> {
        self.0.as_ref().map(Child::id)
    }

    /// Its exit status once it has exited on its own (`None` while it runs, or once
    /// killed).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kill the process (SIGKILL) and wait for it; nothing if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One `redis-server` on 127.0.0.1, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Process,
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
            child: Process::default(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            dir: tempfile::tempdir().expect("temp dir for redis-server"),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        self.child = spawn_server(self.port, self.dir.path(), &self.extra);
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
        self.child.pid()
    }

    /// A plain synchronous connection for assertions.
    pub fn conn(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        client.get_connection_with_timeout(Duration::from_secs(1))
    }

    /// Run a command and return its reply.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.conn().expect("connect to test redis");
        query(&mut c, args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Every key, via SCAN.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.cmd(&["KEYS", "*"]);
        keys.sort();
        keys
    }

    /// Kill the process (SIGKILL) and wait for it.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Start again on the same port (empty: nothing is saved).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}
