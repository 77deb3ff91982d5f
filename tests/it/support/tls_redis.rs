//! `redis-server` over TLS (`--port 0 --tls-port P`) with a CA and certificates made by
//! the test (rcgen, ring), and `redis-cli --tls` to read what the gateway wrote. Also a
//! Redis whose only usable users need a password (ACL), and Sentinels with `requirepass`.
//! Every process is stopped by PID when its owner is dropped.

use super::redis::{free_port, query, redis_server_bin, spawn_sentinel, spawn_server, Process};
use super::topology::{cluster_node_args, create_cluster, redis_cli_bin};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A test CA that issues server and client certificates, written as PEM files.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate's PEM file.
    pub pem: PathBuf,
    dir: PathBuf,
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A CA named `name`, its PEM file written in `dir` as `NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        // Not a leaf's CN: OpenSSL (redis-server as a replica) takes a certificate whose
        // issuer and subject match for a self-signed one.
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&pem, cert.pem()).unwrap();
        TestCa {
            issuer: Issuer::new(params, key),
            pem,
            dir: dir.to_path_buf(),
        }
    }

    /// A certificate with subject CN `cn` and subject alternative names `sans` (DNS
    /// names, or IP addresses such as `127.0.0.1`), written as `FILE.pem` / `FILE.key`.
    pub fn issue(&self, file: &str, cn: &str, sans: &[&str]) -> CertFiles {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let files = CertFiles {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}.key")),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }
}

/// How long the helpers wait for a server to answer before panicking.
const WAIT: Duration = Duration::from_secs(10);

/// One `redis-server` listening with TLS only on 127.0.0.1, killed when dropped.
pub struct TlsRedis {
    /// The TLS port.
    pub port: u16,
    child: Process,
    /// Certificate and key redis-cli presents (always, so `tls-auth-clients yes` servers
    /// answer too).
    client: CertFiles,
    /// The `--requirepass` it was started with, given to redis-cli.
    password: Option<String>,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    /// Start `redis-server --port 0 --tls-port P` with `server` as its certificate,
    /// `ca` for client certificates, and `--tls-auth-clients yes|no` per
    /// `auth_clients`, plus `extra` arguments. Waits (≤ 10 s) until a TLS PING answers.
    pub fn start(ca: &TestCa, server: &CertFiles, auth_clients: bool, extra: &[&str]) -> TlsRedis {
        Self::launch(ca, server, auth_clients, extra, None)
    }

    /// A Sentinel listening with TLS only (`redis-server CONF --sentinel`, `body` the
    /// rest of its config: `sentinel monitor …`), which reaches the nodes it monitors
    /// with TLS (`tls-replication yes`). Waits (≤ 10 s) until a TLS PING answers.
    pub fn sentinel(ca: &TestCa, server: &CertFiles, body: &str) -> TlsRedis {
        Self::launch(ca, server, false, &["--tls-replication", "yes"], Some(body))
    }

    fn launch(
        ca: &TestCa,
        server: &CertFiles,
        auth_clients: bool,
        extra: &[&str],
        sentinel: Option<&str>,
    ) -> TlsRedis {
        let dir = tempfile::tempdir().expect("temp dir for redis-server");
        let client = ca.issue(
            &format!("redis-cli-{}", free_port()),
            "redis-cli",
            &["redis-cli"],
        );
        let port = free_port();
        let mut cmd = Command::new(redis_server_bin());
        if let Some(body) = sentinel {
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(&conf, body).unwrap();
            cmd.arg(&conf).arg("--sentinel");
        }
        let child = cmd
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"])
            .arg("--tls-cert-file")
            .arg(&server.cert)
            .arg("--tls-key-file")
            .arg(&server.key)
            .arg("--tls-ca-cert-file")
            .arg(&ca.pem)
            .args(["--tls-auth-clients", if auth_clients { "yes" } else { "no" }])
            .arg("--dir")
            .arg(dir.path())
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {}: {e}. These tests need a real redis-server built with TLS (Debian's redis-server 7 is)", redis_server_bin())
            });
        let password = extra
            .iter()
            .position(|a| *a == "--requirepass")
            .and_then(|i| extra.get(i + 1))
            .map(|p| p.to_string());
        let mut me = TlsRedis {
            port,
            child: Process::new(child),
            client,
            password,
            _dir: dir,
        };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = me.child.exited() {
                panic!("redis-server --tls-port {port} exited at startup ({status}): is it built with TLS?");
            }
            let ping = me.try_cli(&["PING"]);
            if ping.as_deref() == Ok("PONG") {
                return me;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server --tls-port {port} did not answer a TLS PING: {ping:?}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// `rediss://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// Run `redis-cli --tls` with `args`; its trimmed stdout, or stderr as the error.
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        let mut cli = Command::new(redis_cli_bin());
        if let Some(p) = &self.password {
            cli.args(["-a", p, "--no-auth-warning"]);
        }
        let out = cli
            .args(["--tls", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            // The test's own reads skip verification (a certificate may name a host other
            // than 127.0.0.1 on purpose); the gateway's verification is what is tested.
            .arg("--insecure")
            .arg("--cert")
            .arg(&self.client.cert)
            .arg("--key")
            .arg(&self.client.key)
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || stdout.starts_with("ERR") || stdout.contains("Could not") {
            return Err(format!(
                "{stdout} {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(stdout)
    }

    /// Run `redis-cli --tls` with `args` and return its trimmed stdout (panics on error).
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args)
            .unwrap_or_else(|e| panic!("redis-cli --tls -p {} {args:?}: {e}", self.port))
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cli(&["KEYS", "*"])
            .lines()
            .map(str::to_string)
            .filter(|k| !k.is_empty())
            .collect();
        keys.sort();
        keys
    }

    /// Kill the process (SIGKILL) and wait for it.
    pub fn kill(&mut self) {
        self.child.kill();
    }
}

/// A Redis Cluster of primaries only, every node TLS-only (`--tls-cluster yes`, so the
/// cluster announces the TLS ports), each with `--requirepass password` and
/// `--masterauth password`.
pub struct TlsCluster {
    pub nodes: Vec<TlsRedis>,
    _dir: tempfile::TempDir,
}

impl TlsCluster {
    /// Start three nodes with `server` as their certificate, join them with
    /// `redis-cli --tls --cluster create`, and wait (≤ 10 s) until each reports
    /// `cluster_state:ok` and knows the others.
    pub fn start(ca: &TestCa, server: &CertFiles, password: &str) -> TlsCluster {
        let dir = tempfile::tempdir().expect("tempdir for cluster nodes");
        let nodes: Vec<TlsRedis> = (0..3)
            .map(|_| {
                let mut args = cluster_node_args(dir.path(), 2000);
                for a in ["--tls-cluster", "yes", "--requirepass", password] {
                    args.push(a.to_string());
                }
                args.extend(["--masterauth".to_string(), password.to_string()]);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                TlsRedis::start(ca, server, false, &args)
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let first = &nodes[0];
        let mut cli = Command::new(redis_cli_bin());
        cli.args(["-a", password, "--no-auth-warning", "--tls", "--insecure"])
            .arg("--cert")
            .arg(&first.client.cert)
            .arg("--key")
            .arg(&first.client.key);
        create_cluster(cli, &addrs, 0);
        let deadline = Instant::now() + WAIT;
        for n in &nodes {
            loop {
                let info = n.try_cli(&["CLUSTER", "INFO"]).unwrap_or_default();
                if info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "TLS cluster node on port {} not ready:\n{info}",
                    n.port
                );
                std::thread::sleep(Duration::from_millis(25));
            }
        }
        TlsCluster { nodes, _dir: dir }
    }

    /// Every key on every node, sorted.
    pub fn all_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.nodes.iter().flat_map(TlsRedis::keys).collect();
        keys.sort();
        keys
    }

    /// The node holding `key` (`None` when no node has it).
    pub fn node_with(&self, key: &str) -> Option<&TlsRedis> {
        self.nodes
            .iter()
            .find(|n| n.keys().iter().any(|k| k == key))
    }
}

/// A plain `redis-server` (or `redis-server --sentinel`) process whose clients must
/// authenticate: readiness is probed with `AUTH` first. Killed when dropped.
pub struct AuthedRedis {
    pub port: u16,
    child: Process,
    /// `redis://USER:PASSWORD@127.0.0.1:PORT` of a user allowed everything (the test's
    /// own, for assertions).
    pub admin_url: String,
    _dir: tempfile::TempDir,
}

impl AuthedRedis {
    /// Start `redis-server` with `args` (after the usual test settings) on a free port;
    /// `admin` is the `(user, password)` the test itself talks with. Waits (≤ 10 s)
    /// until that user's PING answers.
    pub fn start(args: &[&str], admin: (&str, &str)) -> AuthedRedis {
        let dir = tempfile::tempdir().expect("temp dir for redis-server");
        let port = free_port();
        let child = spawn_server(port, dir.path(), args);
        Self::wait(child, port, admin, dir)
    }

    /// Start `redis-server CONF --sentinel` with `body` as the rest of its config (after
    /// port, bind and dir); `admin` as in [`AuthedRedis::start`] (a Sentinel with
    /// `requirepass P` takes `("default", P)`).
    pub fn sentinel(body: &str, admin: (&str, &str)) -> AuthedRedis {
        let dir = tempfile::tempdir().expect("temp dir for sentinel");
        let port = free_port();
        let (_, child) = spawn_sentinel(dir.path(), port, body);
        Self::wait(child, port, admin, dir)
    }

    fn wait(child: Process, port: u16, admin: (&str, &str), dir: tempfile::TempDir) -> AuthedRedis {
        let mut me = AuthedRedis {
            port,
            child,
            admin_url: format!("redis://{}:{}@127.0.0.1:{port}", admin.0, admin.1),
            _dir: dir,
        };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = me.child.exited() {
                panic!("redis-server on port {port} exited at startup: {status}");
            }
            if me.try_cmd::<String>(&["PING"]).is_ok() {
                return me;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not start"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// `redis://127.0.0.1:PORT` (no credentials).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Run a command as the admin user; errors come back as `Err`.
    pub fn try_cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let client = redis::Client::open(self.admin_url.as_str())?;
        let mut c = client.get_connection_with_timeout(Duration::from_secs(1))?;
        query(&mut c, args)
    }

    /// Run a command as the admin user and return its reply (panics on error).
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("port {}: {args:?}: {e}", self.port))
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.cmd(&["KEYS", "*"]);
        keys.sort();
        keys
    }

    /// Kill the process (SIGKILL) and wait for it.
    pub fn kill(&mut self) {
        self.child.kill();
    }
}
