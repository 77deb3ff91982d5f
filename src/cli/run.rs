//! `tollgate run`: the gateway in the foreground until SIGTERM or SIGINT, reloading on
//! SIGHUP and on changes to the config file.

use sd_notify::NotifyState;
use std::path::Path;
use std::process::ExitCode;
use tollgate::clock::SystemClock;
use tollgate::config::ConfigFile;
use tollgate::reload::{notify_systemd, reload_on_sighup, take_sighup, watch_file, watch_keys};
use tollgate::Gateway;

/// Run the gateway from `file` (read from `path`, which reloads read again).
pub(crate) async fn run(path: &Path, file: ConfigFile) -> ExitCode {
    tollgate::logging::init(&file.config.log);
    // Before the listeners are bound: a SIGHUP from then on reloads.
    let hup = take_sighup();
    let gateway = match Gateway::start(&file, std::sync::Arc::new(SystemClock)).await {
        Ok(g) => g,
        Err(e) => {
            eprintln!("tollgate: {e}");
            return ExitCode::FAILURE;
        }
    };
    match hup {
        Ok(hup) => reload_on_sighup(gateway.reloader(), path.to_path_buf(), hup),
        Err(e) => tracing::error!(error = %e, "cannot handle SIGHUP; reload by file change only"),
    }
    let _watcher = if file.config.server.watch_config {
        match watch_file(gateway.reloader(), path.to_path_buf()) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the config file; reload with SIGHUP");
                None
            }
        }
    } else {
        None
    };
    let _keys_watcher = if file.config.server.watch_config {
        match watch_keys(gateway.reloader()) {
            Some(Ok(w)) => Some(w),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot watch the keys file; reload with SIGHUP");
                None
            }
            None => None,
        }
    } else {
        None
    };
    // Listeners are bound and the config is loaded.
    notify_systemd(&[NotifyState::Ready]);
    spawn_watchdog();

    wait_for_shutdown_signal().await;
    notify_systemd(&[NotifyState::Stopping]);
    gateway.shutdown();
    gateway.wait().await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// With `WATCHDOG_USEC` set (systemd `WatchdogSec=`), ping the watchdog at half its period.
fn spawn_watchdog() {
    if let Some(period) = sd_notify::watchdog_enabled() {
        tracing::info!(?period, "systemd watchdog enabled");
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period / 2);
            loop {
                tick.tick().await;
                notify_systemd(&[NotifyState::Watchdog]);
            }
        });
    }
}

/// Return on SIGTERM or SIGINT.
async fn wait_for_shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stopping");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
