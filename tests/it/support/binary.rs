//! The `tollgate` binary run as an operator runs it: a child process with its logs
//! (stderr) in a file, signalled with `kill`, killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `tollgate` process.
pub struct Binary {
    pub child: Child,
    /// Where its stderr goes: the config's path with the extension `log`.
    pub log: PathBuf,
}

impl Binary {
    /// Run the binary with `config` and `env`, and wait until `port` accepts connections.
    pub fn spawn(config: &Path, port: u16, env: &[(&str, String)]) -> Binary {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        cmd.arg("--config").arg(config);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::start(cmd, config, port)
    }

    /// [`Binary::spawn`] with the soft limit on open files set to `open_files` (through
    /// the shell's `ulimit -n`).
    pub fn spawn_with_open_files(config: &Path, port: u16, open_files: u64) -> Binary {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -n {open_files} && exec \"$0\" --config \"$1\""
            ))
            .arg(env!("CARGO_BIN_EXE_tollgate"))
            .arg(config);
        Self::start(cmd, config, port)
    }

    fn start(mut cmd: Command, config: &Path, port: u16) -> Binary {
        // `$TOLLGATE_TEST_RUNTIME`: see `runtime_from_env`.
        if let Ok(text) = std::fs::read_to_string(config) {
            let shaped = super::runtime_from_env(&text);
            if shaped != text {
                std::fs::write(config, shaped).unwrap();
            }
        }
        let log = config.with_extension("log");
        cmd.env_remove("RUST_LOG")
            .env_remove("TOLLGATE_CONFIG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            // A gateway that exited (a config error, a port taken meanwhile) says why.
            if let Ok(Some(status)) = child.try_wait() {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("gateway exited ({status}) before listening on {port}:\n{said}");
            }
            if Instant::now() >= deadline {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = child.kill();
                panic!("gateway did not listen on {port} within 10 s; its log:\n{said}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Binary { child, log }
    }

    /// Send a signal (`"-HUP"`, `"-TERM"`).
    pub fn signal(&self, sig: &str) {
        assert!(Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success());
    }

    /// Everything it has logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
