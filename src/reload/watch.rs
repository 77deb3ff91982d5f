//! The triggers of a reload: SIGHUP, and changes to the config file (or a TLS file it
//! names, or the keys file) seen by watching their directories, debounced and settled.
//!
//! Watching the directory rather than the file catches editors that write a new file and
//! rename it over the old one, and Kubernetes ConfigMap mounts, where the file is a
//! symlink whose target directory is swapped atomically. A watcher event only reloads
//! when the file's content differs from the running config.

use super::{Reloader, DEBOUNCE};
use notify::{RecursiveMode, Watcher};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// Reload on every SIGHUP (`hup`, from [`take_sighup`]) until the process ends.
pub fn reload_on_sighup(reloader: Reloader, path: PathBuf, mut hup: tokio::signal::unix::Signal) {
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!(config = %path.display(), "SIGHUP: reloading");
            // Reading, validating and reporting a big file takes CPU time: a blocking
            // thread does it, so the workers keep serving requests meanwhile.
            let (reloader, path) = (reloader.clone(), path.clone());
            let _ = tokio::task::spawn_blocking(move || {
                let before = reloader.0.snapshot.load_full();
                let _ = reloader.reload_from(&path, false);
                // A reload that kept the keys did not read the keys file: read it now.
                let kept = reloader
                    .0
                    .snapshot
                    .load()
                    .identities
                    .shares_keys(&before.identities);
                drop(before);
                if kept {
                    reloader.reload_keys(false);
                }
            })
            .await;
        }
    });
}

/// Watch the directory of `path` (and those of the TLS certificate files the running
/// config names) and reload when the config file's content, or a certificate file's,
/// changes. The returned watcher must be kept alive; dropping it stops watching.
///
/// Errors: the watcher could not be set up (e.g. no inotify instances left).
pub fn watch_file(reloader: Reloader, path: PathBuf) -> notify::Result<notify::RecommendedWatcher> {
    let dir = crate::tls::base_dir(&path);
    let mut files = vec![path.clone()];
    files.extend(reloader.tls_files());
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let watched = files.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            // Only events about the config file or a certificate file (or the symlink it
            // goes through): other files in the directory, such as a log file, must not
            // trigger reloads.
            if !event.kind.is_access()
                && event
                    .paths
                    .iter()
                    .any(|p| watched.iter().any(|f| concerns(f, p)))
            {
                let _ = tx.send(());
            }
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    tracing::info!(dir = %dir.display(), "watching the config directory for changes");
    let mut dirs = vec![dir];
    for f in &files[1..] {
        let d = crate::tls::base_dir(f);
        if !dirs.contains(&d) {
            watcher.watch(&d, RecursiveMode::NonRecursive)?;
            tracing::info!(dir = %d.display(), "watching a TLS certificate directory for changes");
            dirs.push(d);
        }
    }
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Debounce: one reload for a burst of events (write, rename, chmod…).
            tokio::time::sleep(DEBOUNCE).await;
            while rx.try_recv().is_ok() {}
            let Some(text) = settled(&path, &mut rx).await else {
                continue;
            };
            let reloader = reloader.clone();
            let path = path.clone();
            let _ = tokio::task::spawn_blocking(move || match text {
                Ok(text) => reloader.reload_text(&path, text, true),
                Err(_) => reloader.reload_from(&path, true),
            })
            .await;
        }
    });
    Ok(watcher)
}

/// Watch the directory of the running config's `identity.clients_file` and reload the
/// keys (only them) when the file changes and settles: its size and modification time
/// stay the same for `identity.clients_file_settle` with no new event. The new set is built on a blocking
/// thread and swapped in whole; a broken file is logged (`PATH:LINE: what is wrong`)
/// and the running keys stay. `None` when the config has no keys file. The returned
/// watcher must be kept alive.
///
/// Errors: the watcher could not be set up.
pub fn watch_keys(reloader: Reloader) -> Option<notify::Result<notify::RecommendedWatcher>> {
    let path = reloader
        .0
        .snapshot
        .load()
        .identities
        .clients_file()?
        .to_path_buf();
    Some(watch_keys_file(reloader, path))
}

fn watch_keys_file(
    reloader: Reloader,
    path: PathBuf,
) -> notify::Result<notify::RecommendedWatcher> {
    let dir = crate::tls::base_dir(&path);
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let watched = path.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            if !event.kind.is_access() && event.paths.iter().any(|p| concerns(&watched, p)) {
                let _ = tx.send(());
            }
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    tracing::info!(file = %path.display(), "watching the keys file for changes");
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            tokio::time::sleep(DEBOUNCE).await;
            while rx.try_recv().is_ok() {}
            let settle = reloader
                .0
                .snapshot
                .load()
                .config
                .identity
                .clients_file_settle
                .0;
            if !settled_metadata(&path, &mut rx, settle).await {
                continue;
            }
            let reloader = reloader.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload_keys(true)).await;
        }
    });
    Ok(watcher)
}

/// Whether the file's size and modification time stayed the same over `settle` with
/// no file event in between (false when it kept changing for [`SETTLE_LIMIT`], or for
/// three times `settle` when that is longer). Unlike [`settled`], the content is not
/// read: a keys file may be hundreds of megabytes.
async fn settled_metadata(
    path: &Path,
    events: &mut mpsc::UnboundedReceiver<()>,
    settle: Duration,
) -> bool {
    let look = |path: &Path| {
        std::fs::metadata(path)
            .ok()
            .map(|m| (m.len(), m.modified().ok()))
    };
    let started = tokio::time::Instant::now();
    let mut before = look(path);
    while started.elapsed() < SETTLE_LIMIT.max(settle * 3) {
        tokio::time::sleep(settle.max(Duration::from_millis(10))).await;
        let mut quiet = true;
        while events.try_recv().is_ok() {
            quiet = false;
        }
        let now = look(path);
        if quiet && now == before {
            return true;
        }
        before = now;
    }
    tracing::warn!(file = %path.display(), "the keys file kept changing; not reloaded until it settles");
    false
}

/// How long the config file's bytes must stay the same (and no new event arrive) before
/// a watcher reloads it: a file still being written is never applied half-written.
pub const SETTLE: Duration = Duration::from_millis(200);

/// How long a watcher waits for a changing file to settle before it gives up (until the
/// next change).
pub const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// The config file's text once two reads [`SETTLE`] apart agree with no file event in
/// between; `Some(Err)` when the file cannot be read (the reload reports it), `None` when
/// it kept changing for [`SETTLE_LIMIT`].
async fn settled(
    path: &Path,
    events: &mut mpsc::UnboundedReceiver<()>,
) -> Option<std::io::Result<String>> {
    let started = tokio::time::Instant::now();
    let mut before = tokio::fs::read(path).await;
    while started.elapsed() < SETTLE_LIMIT {
        tokio::time::sleep(SETTLE).await;
        let mut quiet = true;
        while events.try_recv().is_ok() {
            quiet = false;
        }
        let now = tokio::fs::read(path).await;
        let same = match (&before, &now) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.kind() == b.kind(),
            _ => false,
        };
        if quiet && same {
            return Some(now.and_then(|bytes| {
                String::from_utf8(bytes).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error())
                })
            }));
        }
        before = now;
    }
    tracing::warn!(
        config = %path.display(),
        "the config file kept changing for {}s; not reloaded until it settles",
        SETTLE_LIMIT.as_secs()
    );
    None
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
