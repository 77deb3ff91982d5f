//! Reload triggers: SIGHUP, and changes to the config file seen by watching its
//! directory (debounced), plus the systemd notifications around a reload.
//!
//! Watching the directory rather than the file catches editors that write a new file and
//! rename it over the old one, and Kubernetes ConfigMap mounts, where the file is a
//! symlink whose target directory is swapped atomically. A watcher event only reloads
//! when the file's content differs from the running config.

use crate::server::Reloader;
use notify::{RecursiveMode, Watcher};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

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

/// Reload on every SIGHUP until the process ends.
pub fn reload_on_sighup(reloader: Reloader, path: PathBuf) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!(config = %path.display(), "SIGHUP: reloading");
            let _ = reloader.reload_from(&path, false);
        }
    });
    Ok(())
}

/// Watch the directory of `path` and reload when the file's content changes. The
/// returned watcher must be kept alive; dropping it stops watching.
///
/// Errors: the watcher could not be set up (e.g. no inotify instances left).
pub fn watch_file(reloader: Reloader, path: PathBuf) -> notify::Result<notify::RecommendedWatcher> {
    let dir = watched_dir(&path);
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let file = path.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            // Only events about the config file itself (or the symlink it goes through):
            // other files in the directory, such as a log file, must not trigger reloads.
            if !event.kind.is_access() && event.paths.iter().any(|p| concerns(&file, p)) {
                let _ = tx.send(());
            }
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    tracing::info!(dir = %dir.display(), "watching the config directory for changes");
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Debounce: one reload for a burst of events (write, rename, chmod…).
            tokio::time::sleep(DEBOUNCE).await;
            while rx.try_recv().is_ok() {}
            let reloader = reloader.clone();
            let path = path.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload_from(&path, true)).await;
        }
    });
    Ok(watcher)
}

/// Whether a change to `changed` (a path in the config file's directory) can change the
/// config file at `config`: it is the file itself, or the first step of the symlink the
/// file is (Kubernetes ConfigMaps: `tollgate.toml -> ..data/tollgate.toml`, where `..data`
/// is swapped).
fn concerns(config: &Path, changed: &Path) -> bool {
    let Some(name) = changed.file_name() else {
        return false;
    };
    if Some(name) == config.file_name() {
        return true;
    }
    std::fs::read_link(config)
        .ok()
        .and_then(|target| target.components().next().map(|c| c.as_os_str().to_owned()))
        .is_some_and(|first| first == name)
}

fn watched_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
