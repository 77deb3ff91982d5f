//! The `tollgate` command line: run the gateway, check a config file, or probe a running
//! gateway's health (for container HEALTHCHECKs).

use clap::{Parser, Subcommand};
use sd_notify::NotifyState;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tollgate::clock::SystemClock;
use tollgate::config;
use tollgate::config::RuntimeShape;
use tollgate::reload::{notify_systemd, reload_on_sighup, take_sighup, watch_file, watch_keys};
use tollgate::snapshot::{reshard_warning, Snapshot};
use tollgate::Gateway;

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting reverse proxy",
    after_help = CONFIG_REFERENCE
)]
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

/// Where `--help` sends a reader for the config keys.
const CONFIG_REFERENCE: &str =
    "The config file is TOML; docs/configuration.md (in tollgate's source) is the full \
reference of its keys: type, default, rules and when a change takes effect.";

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in the foreground (the default).
    Run,
    /// Parse and validate the config, touch nothing; exit 1 on any error.
    #[command(after_help = CONFIG_REFERENCE)]
    Check {
        /// The config running now: warn about what a reload to --config would change
        /// that callers notice (e.g. a changed shard list).
        #[arg(long, value_name = "PATH")]
        against: Option<PathBuf>,
    },
    /// Who is being limited now: GET /top of a running gateway, refreshed every second.
    Top {
        /// The admin listener, HOST:PORT. Default: the config's `server.admin_listen`.
        #[arg(long, value_name = "ADDR")]
        admin: Option<String>,
        /// Callers per limit.
        #[arg(long, default_value_t = 10)]
        n: usize,
        /// Print once and exit (for scripts).
        #[arg(long)]
        once: bool,
    },
    /// What --config would have refused: decide every request of access logs with its
    /// routes, clients and limits, offline, with the logs' timestamps as the clock.
    #[command(after_help = REPLAY_HELP)]
    Replay {
        /// Compare with this config (e.g. the one running now): both side by side, and
        /// the callers whose verdicts change.
        #[arg(long, value_name = "OLD.toml")]
        compare: Option<PathBuf>,
        /// `text` (a table) or `json` (one document on stdout).
        #[arg(long, default_value = "text", value_parser = ["text", "json"])]
        format: String,
        /// Callers listed per limit and tier.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Draw the callers refused most, minute by minute, to this SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
        /// Access logs: tollgate's (text or JSON) or nginx `combined`; gzip-compressed
        /// files are read as such. Read in the order of their first request.
        #[arg(required = true, value_name = "ACCESS_LOG")]
        logs: Vec<PathBuf>,
    },
    /// API keys for `identity.clients_file`.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Exit 0 when the gateway's admin listener answers GET /healthz with 200, else 1.
    Healthcheck {
        /// The URL to probe. Default: /healthz on the config's `server.admin_listen`.
        #[arg(long)]
        url: Option<String>,
        /// How long to wait for the answer.
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        timeout: Duration,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Make a new random key: print it once, then its keys-file line (only the key's
    /// SHA-256 is in it), and append the line to --clients-file when given.
    New {
        /// The client id (a rotated key gets the id of the key it replaces).
        #[arg(long)]
        id: String,
        /// The client's tier.
        #[arg(long, default_value = "default")]
        tier: String,
        /// A label for logs and /top (never the key).
        #[arg(long)]
        label: Option<String>,
        /// The keys file to append the line to.
        #[arg(long, value_name = "PATH")]
        clients_file: Option<PathBuf>,
    },
}

/// Where `tollgate replay --help` sends a reader.
const REPLAY_HELP: &str = "Lines that cannot be read are counted and the first ones shown; \
they never stop the replay. docs/operations.md, \"Replaying a config over access logs\", \
says what each log format needs and what replay cannot know.";

/// `tollgate replay`: the report on stdout; exit 1 when a config or a log cannot be read.
fn replay(opts: &tollgate::replay::Options, json: bool) -> ExitCode {
    match tollgate::replay::run(opts) {
        Ok(report) => {
            if json {
                match serde_json::to_string_pretty(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("tollgate replay: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", report.text());
            }
            if let Some(svg) = &opts.plot {
                eprintln!("plot written to {}", svg.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate replay: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate key new`: the key on the first line of stdout, the JSON line on the second.
fn key_new(id: &str, tier: &str, label: Option<&str>, file: Option<&Path>) -> ExitCode {
    if id.trim().is_empty() || tier.trim().is_empty() {
        eprintln!("tollgate key new: --id and --tier must not be empty");
        return ExitCode::FAILURE;
    }
    let made = match tollgate::identity::keys::new_key(id, tier, label) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("tollgate key new: cannot read random bytes: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = file {
        if let Err(e) = tollgate::identity::keys::append_line(path, &made.line) {
            eprintln!("tollgate key new: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!(
            "appended to {}; the key is shown once, here: hand it to the client now",
            path.display()
        );
    }
    println!("{}", made.key);
    println!("{}", made.line);
    ExitCode::SUCCESS
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    config::duration::parse_duration(s)
}

/// mimalloc: fewer instructions per allocation than glibc's malloc on the request path
/// (measured with callgrind; see BENCHMARKS.md and [`tollgate::alloc`]).
#[global_allocator]
static GLOBAL: tollgate::alloc::Mimalloc = tollgate::alloc::Mimalloc;

fn main() -> ExitCode {
    tollgate::install_crypto_provider();
    let cli = Cli::parse();
    let command = cli.command.unwrap_or(Command::Run);
    if let Command::Key {
        command:
            KeyCommand::New {
                id,
                tier,
                label,
                clients_file,
            },
    } = &command
    {
        return key_new(id, tier, label.as_deref(), clients_file.as_deref());
    }
    // `server.runtime` and `server.workers` shape the runtime, so they are read before it
    // exists; an unreadable file is reported by `run` below.
    let server = match command {
        Command::Run => config::read(&cli.config).ok().map(|f| f.config.server),
        _ => None,
    };
    let mut builder = match server.as_ref().map(|s| s.runtime) {
        // The proxy listener gets its own worker threads (`Gateway::start`): this runtime
        // only runs the admin listener, the reloader, the store's background tasks and
        // the signal handlers.
        Some(RuntimeShape::PerCore) => tokio::runtime::Builder::new_current_thread(),
        _ => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = server.and_then(|s| s.workers).filter(|n| *n > 0) {
                builder.worker_threads(n);
            }
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match command {
        Command::Check { against } => runtime.block_on(check(&cli.config, against.as_deref())),
        Command::Run => runtime.block_on(run(&cli.config)),
        Command::Healthcheck { url, timeout } => {
            runtime.block_on(healthcheck(&cli.config, url, timeout))
        }
        Command::Key { .. } => ExitCode::SUCCESS,
        Command::Replay {
            compare,
            format,
            top,
            plot,
            logs,
        } => {
            use std::io::IsTerminal;
            // Snapshot building may need a runtime context (the store is built, not
            // started); the replay itself is synchronous.
            let _guard = runtime.enter();
            let opts = tollgate::replay::Options {
                config: cli.config.clone(),
                compare,
                logs,
                top,
                plot,
                progress: std::io::stderr().is_terminal(),
            };
            replay(&opts, format == "json")
        }
        Command::Top { admin, n, once } => runtime.block_on(top(&cli.config, admin, n, once)),
    }
}

/// `tollgate check`: every error as `PATH:LINE:COLUMN: key.path: message`.
async fn check(path: &Path, against: Option<&Path>) -> ExitCode {
    let built = config::read(path).and_then(|file| Snapshot::build(&file, None));
    match built {
        Ok(snap) => {
            for w in &snap.warnings {
                eprintln!("{w}");
            }
            if let Some(old) = against {
                match config::read(old) {
                    Ok(old) => {
                        if let Some((key, w)) =
                            reshard_warning(&old.config.store, &snap.config.store)
                        {
                            eprintln!("warning: {}: {key}: {w}", path.display());
                        }
                    }
                    Err(report) => eprint!("{report}"),
                }
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

/// `tollgate top`: GET /top every second, as a table: per limit and caller, refusals a
/// second (since the previous poll), refusals in the current and the previous minute,
/// and the units used and left in the caller's current window (`-`: unknown).
async fn top(path: &Path, admin: Option<String>, n: usize, once: bool) -> ExitCode {
    let admin = match admin {
        Some(a) => a,
        None => match config::read(path) {
            Ok(file) => match file.config.server.admin_listen {
                Some(a) => a,
                None => {
                    eprintln!(
                        "tollgate top: {}: server.admin_listen is not set; pass --admin",
                        path.display()
                    );
                    return ExitCode::FAILURE;
                }
            },
            Err(report) => {
                eprint!("{report}");
                return ExitCode::FAILURE;
            }
        },
    };
    let url = format!("http://{admin}/top?n={n}");
    let Ok(uri) = url.parse::<http::Uri>() else {
        eprintln!("tollgate top: {admin:?} is not HOST:PORT");
        return ExitCode::FAILURE;
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let mut before: std::collections::HashMap<(String, String), (u64, std::time::Instant)> =
        std::collections::HashMap::new();
    loop {
        use http_body_util::BodyExt;
        let body = match client.get(uri.clone()).await {
            Ok(r) => r.into_body().collect().await.map(|b| b.to_bytes()).ok(),
            Err(e) => {
                eprintln!("tollgate top: {url}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let Some(v) = body.and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        else {
            eprintln!("tollgate top: {url}: not a /top answer");
            return ExitCode::FAILURE;
        };
        let now = std::time::Instant::now();
        let mut out = String::new();
        if !once {
            out.push_str("\x1b[H\x1b[2J");
        }
        out.push_str(&format!(
            "{:<16} {:<32} {:<12} {:>10} {:>10} {:>12} {:>10}\n",
            "LIMIT", "CALLER", "TIER", "REFUSED/S", "REFUSED", "USED", "REMAINING"
        ));
        for limit in v["limits"].as_array().into_iter().flatten() {
            let name = limit["name"].as_str().unwrap_or("");
            // Per caller: tier, refusals, units used and left in its current window.
            type Row = (String, u64, Option<u64>, Option<u64>);
            let mut rows: std::collections::BTreeMap<String, Row> =
                std::collections::BTreeMap::new();
            for (list, refused) in [("refused", true), ("used", false)] {
                for h in limit[list].as_array().into_iter().flatten() {
                    let caller = h["caller"].as_str().unwrap_or("").to_string();
                    let row = rows.entry(caller).or_default();
                    row.0 = h["tier"].as_str().unwrap_or("").to_string();
                    row.2 = row.2.or(h["used"].as_u64());
                    row.3 = row.3.or(h["remaining"].as_u64());
                    if refused {
                        row.1 = h["count"].as_u64().unwrap_or(0);
                    }
                }
            }
            let mut rows: Vec<_> = rows.into_iter().collect();
            rows.sort_by_key(|(_, (_, refused, used, _))| std::cmp::Reverse((*refused, *used)));
            for (caller, (tier, refused, used, remaining)) in rows {
                let key = (name.to_string(), caller.clone());
                let rate = match before.insert(key, (refused, now)) {
                    Some((was, at)) if refused >= was => {
                        (refused - was) as f64 / now.duration_since(at).as_secs_f64().max(0.001)
                    }
                    _ => 0.0,
                };
                let used = used.map_or("-".to_string(), |u| u.to_string());
                let remaining = remaining.map_or("-".to_string(), |r| r.to_string());
                out.push_str(&format!(
                    "{name:<16} {caller:<32} {tier:<12} {rate:>10.1} {refused:>10} {used:>12} {remaining:>10}\n"
                ));
            }
        }
        print!("{out}");
        if once {
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `tollgate healthcheck`: GET /healthz on the admin listener.
async fn healthcheck(path: &Path, url: Option<String>, timeout: Duration) -> ExitCode {
    let url = match url {
        Some(u) => u,
        None => match config::read(path) {
            Ok(file) => match file.config.server.admin_listen {
                Some(addr) => format!("http://{addr}/healthz"),
                None => {
                    eprintln!(
                        "tollgate healthcheck: {}: server.admin_listen is not set; pass --url",
                        path.display()
                    );
                    return ExitCode::FAILURE;
                }
            },
            Err(report) => {
                eprint!("{report}");
                return ExitCode::FAILURE;
            }
        },
    };
    let uri: http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("tollgate healthcheck: {url:?}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    match tokio::time::timeout(timeout, client.get(uri)).await {
        Ok(Ok(resp)) if resp.status().is_success() => {
            println!("ok: {url} answered {}", resp.status());
            ExitCode::SUCCESS
        }
        Ok(Ok(resp)) => {
            eprintln!("unhealthy: {url} answered {}", resp.status());
            ExitCode::FAILURE
        }
        Ok(Err(e)) => {
            eprintln!("unhealthy: {url}: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("unhealthy: {url}: no answer within {timeout:?}");
            ExitCode::FAILURE
        }
    }
}
