//! Reloading: the [`Reloader`] that builds a new snapshot and swaps it in, its triggers
//! ([`watch`]: SIGHUP, and changes to the config file seen by watching its directory,
//! debounced), and the systemd notifications around a reload. The server hands it what
//! it needs (the snapshot holder, the metrics, how to start a new store), so this module
//! does not depend on the server.

mod watch;

pub use watch::{reload_on_sighup, watch_file, watch_keys, SETTLE, SETTLE_LIMIT};

use crate::clock::SharedClock;
use crate::config::{ConfigFile, ConfigReport};
use crate::identity::KeysReload;
use crate::metrics::{Metrics, ReloadLabels};
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long to wait after a file event for more before reloading.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// Send `state` to systemd when `NOTIFY_SOCKET` is set (ignored otherwise).
pub fn notify_systemd(state: &[sd_notify::NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        if let Err(e) = sd_notify::notify(state) {
            tracing::debug!(error = %e, "sd_notify failed");
        }
    }
}

/// `RELOADING=1` with `MONOTONIC_USEC`, as `Type=notify-reload` wants.
pub fn notify_systemd_reloading() {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    match sd_notify::NotifyState::monotonic_usec_now() {
        Ok(now) => notify_systemd(&[sd_notify::NotifyState::Reloading, now]),
        Err(_) => notify_systemd(&[sd_notify::NotifyState::Reloading]),
    }
}

/// Take over SIGHUP (from now on it no longer ends the process: it is held until
/// [`reload_on_sighup`] acts on it). Called before the listeners are bound, so that a
/// SIGHUP sent as soon as the port answers reloads instead of killing the gateway.
pub fn take_sighup() -> std::io::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new snapshot is active: its generation and warnings.
    Applied {
        /// The new generation.
        generation: u64,
        /// Warnings about the new config.
        warnings: Vec<String>,
    },
    /// The file's content is the one already running; nothing changed.
    Unchanged,
}

/// Reloads a gateway's config; cheap to clone, usable from any task.
#[derive(Debug, Clone)]
pub struct Reloader(Arc<State>);

/// What reloading needs of a gateway.
struct State {
    snapshot: Arc<ArcSwap<Snapshot>>,
    clock: SharedClock,
    metrics: Arc<Metrics>,
    /// Starts what a new store needs in the background (the server's job).
    start_store: fn(&Snapshot, SharedClock),
    /// Serializes reloads (SIGHUP and the file watcher may race).
    reload_lock: std::sync::Mutex<()>,
    /// Content hash of the last file that failed to load, so that a watcher does not
    /// retry the same broken content on every unrelated event.
    last_failed: std::sync::Mutex<Option<String>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

impl Reloader {
    /// A reloader that swaps snapshots in `snapshot`, counts in `metrics`, and calls
    /// `start_store` for a snapshot that brings a new store.
    pub fn new(
        snapshot: Arc<ArcSwap<Snapshot>>,
        clock: SharedClock,
        metrics: Arc<Metrics>,
        start_store: fn(&Snapshot, SharedClock),
    ) -> Self {
        Self(Arc::new(State {
            snapshot,
            clock,
            metrics,
            start_store,
            reload_lock: std::sync::Mutex::new(()),
            last_failed: std::sync::Mutex::new(None),
        }))
    }

    /// The TLS files (certificates, keys, client CA) of the running config.
    pub fn tls_files(&self) -> Vec<PathBuf> {
        let snap = self.0.snapshot.load();
        snap.tls
            .as_ref()
            .map(|t| t.files().to_vec())
            .unwrap_or_default()
    }

    /// Read the running config's `identity.clients_file` again and swap the new key set
    /// in (validated as a whole; a broken file is logged as `PATH:LINE: what is wrong`
    /// lines, capped, and the running keys stay). With `watched` (the file watcher), a
    /// file whose size and modification time are those already loaded is left alone,
    /// and a set that would remove more than `identity.clients_file_max_removed_percent`
    /// of the keys is held (logged at warn) until a reload without `watched` (SIGHUP)
    /// confirms it. Returns whether a new set is in use.
    pub fn reload_keys(&self, watched: bool) -> bool {
        let _serial = self.0.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let snap = self.0.snapshot.load_full();
        let Some(path) = snap.identities.clients_file() else {
            return false;
        };
        if watched && snap.identities.keys().same_file(path) {
            return false;
        }
        let started = std::time::Instant::now();
        let hold = watched.then_some(snap.config.identity.clients_file_max_removed_percent);
        match snap.identities.reload_keys(hold) {
            Ok(KeysReload::Held {
                removed,
                running,
                keys,
            }) => {
                tracing::warn!(
                    file = %path.display(),
                    removed,
                    running,
                    keys,
                    "keys file held: it would remove {removed} of the {running} keys in use (more than identity.clients_file_max_removed_percent = {}%, or every key of the file); the running keys stay until SIGHUP confirms it (write a new file and rename it over the old one to replace it at once)",
                    snap.config.identity.clients_file_max_removed_percent
                );
                false
            }
            Ok(KeysReload::Applied { clients, keys }) => {
                tracing::info!(
                    file = %path.display(),
                    clients,
                    keys,
                    ms = started.elapsed().as_millis() as u64,
                    "keys file reloaded"
                );
                true
            }
            Err(errors) => {
                for line in errors.lines() {
                    tracing::error!("{line}");
                }
                tracing::error!(file = %path.display(), "keys file rejected; the running keys stay");
                false
            }
        }
    }

    /// Count a reload in `tollgate_reloads_total{result}`.
    fn count(&self, result: &'static str) {
        self.0
            .metrics
            .reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// Read the files `file` names ([`crate::load::Loaded::load`]), build a new snapshot from them and
    /// swap it in; requests in flight finish on the one they started with. An invalid
    /// file changes nothing (and is counted as a failed reload). The store (and its Redis
    /// connections) and the over-limit cache are kept when `[store]` did not change.
    ///
    /// Errors: the [`ConfigReport`] of an invalid file.
    pub fn reload(&self, file: &ConfigFile) -> Result<ReloadOutcome, ConfigReport> {
        let _serial = self.0.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.0.snapshot.load_full();
        let files = crate::load::Loaded::load(file, Some(&current.identities));
        self.apply(file, &files, &current)
    }

    /// [`Reloader::reload`] with the files already loaded against `current`, the running
    /// snapshot (the caller holds the reload lock, so it is still the running one).
    fn apply(
        &self,
        file: &ConfigFile,
        files: &crate::load::Loaded,
        current: &Arc<Snapshot>,
    ) -> Result<ReloadOutcome, ConfigReport> {
        let mut snap = match Snapshot::build(file, files, Some(current)) {
            Ok(s) => s,
            Err(report) => {
                self.count("failed");
                return Err(report);
            }
        };
        if !Arc::ptr_eq(snap.limiter.store(), current.limiter.store()) {
            (self.0.start_store)(&snap, self.0.clock.clone());
        }
        if let Some(tracer) = &snap.tracer {
            tracer.start(&self.0.metrics);
        }
        let mut warnings = snap.warnings.clone();
        let (running_server, running_log) = &*snap.running;
        // Certificates reload; TLS on or off is decided at start.
        let mut server = snap.config.server.clone();
        if server.tls.is_some() && running_server.tls.is_some() {
            server.tls = running_server.tls.clone();
        }
        // The admin token is read from the new config by every admin request.
        server
            .admin_token_sha256
            .clone_from(&running_server.admin_token_sha256);
        if server != *running_server {
            warnings.push(
                "[server] changed: listen addresses and timeouts take effect after a restart"
                    .into(),
            );
        }
        if snap.config.log != *running_log {
            warnings.push("[log] changed: takes effect after a restart".into());
        }
        snap.generation = current.generation + 1;
        let generation = snap.generation;
        self.0.metrics.set_tls_certs(snap.tls.as_deref());
        self.0.snapshot.store(Arc::new(snap));
        self.count("ok");
        self.0.metrics.config_generation.set(generation as i64);
        Ok(ReloadOutcome::Applied {
            generation,
            warnings,
        })
    }

    /// Read the file at `path` and [`Reloader::reload`] it, telling systemd
    /// (`RELOADING=1` with `MONOTONIC_USEC`, then `READY=1`) when `NOTIFY_SOCKET` is set.
    /// With `skip_unchanged` (file watchers, which see many events for one save), a file
    /// whose content is the running one, or the one that failed last, is left alone.
    /// Logs the outcome.
    pub fn reload_from(
        &self,
        path: &std::path::Path,
        skip_unchanged: bool,
    ) -> Result<ReloadOutcome, ConfigReport> {
        self.reload_read(path, crate::config::read(path), skip_unchanged)
    }

    /// [`Reloader::reload_from`] with the file's `text` already read (by a watcher that
    /// saw it settle).
    pub fn reload_text(
        &self,
        path: &std::path::Path,
        text: String,
        skip_unchanged: bool,
    ) -> Result<ReloadOutcome, ConfigReport> {
        self.reload_read(path, crate::config::parse(path, text), skip_unchanged)
    }

    fn reload_read(
        &self,
        path: &std::path::Path,
        read: Result<ConfigFile, ConfigReport>,
        skip_unchanged: bool,
    ) -> Result<ReloadOutcome, ConfigReport> {
        let failed_before = |hash: &str| {
            self.0
                .last_failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_deref()
                == Some(hash)
        };
        let remember_failure = |hash: Option<String>| {
            *self.0.last_failed.lock().unwrap_or_else(|e| e.into_inner()) = hash;
        };
        let result = match read {
            Err(report) => {
                // Unparsable (the text is known) or unreadable: a failed reload like any
                // other, unless a watcher sees the same broken text again.
                let hash =
                    (!report.text.is_empty()).then(|| crate::snapshot::content_hash(&report.text));
                if skip_unchanged && hash.as_deref().is_some_and(failed_before) {
                    return Ok(ReloadOutcome::Unchanged);
                }
                self.count("failed");
                remember_failure(hash);
                Err(report)
            }
            Ok(file) => {
                let _serial = self.0.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
                let running = self.0.snapshot.load_full();
                // Every file the config names, read once: the snapshot is built from
                // these bytes. The config's text and the contents of its TLS files tell
                // whether there is anything to do: a changed certificate is a change to
                // reload even when the text is the same.
                let files = crate::load::Loaded::load(&file, Some(&running.identities));
                let text_hash = crate::snapshot::content_hash(&file.text);
                let tls_hash = crate::tls::loaded_digest(&files.files);
                let hash = format!("{text_hash}{tls_hash}");
                let running_tls = match (&running.config.server.tls, &running.tls) {
                    (Some(_), Some(tls)) => tls.digest(),
                    _ => "",
                };
                let same = text_hash == running.content_hash && tls_hash == running_tls;
                if skip_unchanged && (same || failed_before(&hash)) {
                    Ok(ReloadOutcome::Unchanged)
                } else {
                    notify_systemd_reloading();
                    let outcome = self.apply(&file, &files, &running);
                    notify_systemd(&[sd_notify::NotifyState::Ready]);
                    remember_failure(outcome.is_err().then_some(hash));
                    outcome
                }
            }
        };
        match &result {
            Ok(ReloadOutcome::Applied {
                generation,
                warnings,
            }) => {
                for w in warnings {
                    tracing::warn!("{w}");
                }
                tracing::info!(config = %path.display(), generation, "config reloaded");
            }
            Ok(ReloadOutcome::Unchanged) => {
                tracing::debug!(config = %path.display(), "config unchanged")
            }
            Err(report) => {
                for line in report.error_lines() {
                    tracing::error!("{line}");
                }
                tracing::error!(config = %path.display(), "reload rejected; the running config stays");
            }
        }
        result
    }
}
