//! The `tollgate` command line: run the gateway, or check a config file.

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tollgate::clock::SystemClock;
use tollgate::config;
use tollgate::snapshot::Snapshot;
use tollgate::Gateway;

#[derive(Parser)]
#[command(name = "tollgate", version, about = "A rate-limiting reverse proxy")]
struct Cli {
    /// Config file. Default: $TOLLGATE_CONFIG, then /etc/tollgate/tollgate.toml.
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_CONFIG",
        default_value = "/etc/tollgate/tollgate.toml"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in the foreground (the default).
    Run,
    /// Parse and validate the config, touch nothing; exit 1 on any error.
    Check,
}

fn main() -> ExitCode {
    tollgate::install_crypto_provider();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => runtime.block_on(check(&cli.config)),
        Command::Run => runtime.block_on(run(&cli.config)),
    }
}

/// `tollgate check`: every error as `PATH:LINE:COLUMN: key.path: message`.
async fn check(path: &Path) -> ExitCode {
    let built = config::read(path).and_then(|file| Snapshot::build(&file, None));
    match built {
        Ok(snap) => {
            for w in &snap.warnings {
                eprintln!("{w}");
            }
            println!("{}: {}", path.display(), snap.summary());
            ExitCode::SUCCESS
        }
        Err(report) => {
            for line in report.warning_lines() {
                eprintln!("{line}");
            }
            for line in report.error_lines() {
                eprintln!("{line}");
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(path: &Path) -> ExitCode {
    let file = match config::read(path) {
        Ok(f) => f,
        Err(report) => {
            eprint!("{report}");
            return ExitCode::FAILURE;
        }
    };
    tollgate::logging::init(&file.config.log);
    let gateway = match Gateway::start(&file, std::sync::Arc::new(SystemClock)).await {
        Ok(g) => g,
        Err(e) => {
            eprintln!("tollgate: {e}");
            return ExitCode::FAILURE;
        }
    };
    wait_for_signals(&gateway, path).await;
    gateway.shutdown();
    gateway.wait().await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Reload on SIGHUP; return on SIGTERM or SIGINT.
async fn wait_for_signals(gateway: &Gateway, path: &Path) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot install signal handlers; stopping");
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM received"); return; }
            _ = int.recv() => { tracing::info!("SIGINT received"); return; }
            _ = hup.recv() => {
                match config::read(path).and_then(|file| gateway.reload(&file).map(|w| (w, file))) {
                    Ok((warnings, _)) => {
                        for w in warnings {
                            tracing::warn!("{w}");
                        }
                        tracing::info!(config = %path.display(), "config reloaded");
                    }
                    Err(report) => {
                        for line in report.error_lines() {
                            tracing::error!("{line}");
                        }
                        tracing::error!(config = %path.display(), "reload rejected; the running config stays");
                    }
                }
            }
        }
    }
}
