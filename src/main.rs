//! The `tollgate` command line: run the gateway, check a config file, or probe a running
//! gateway's health (for container HEALTHCHECKs). Each subcommand is a module of
//! [`cli`]; this file parses the arguments, builds the async runtime and dispatches.

mod cli;

use clap::Parser;
use cli::{Cli, Command, KeyCommand};
use std::process::ExitCode;
use tollgate::config::{self, RuntimeShape, ServerConfig};

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
        return cli::key::key_new(id, tier, label.as_deref(), clients_file.as_deref());
    }
    // `run` reads its config file once, here: `server.runtime` and `server.workers`
    // shape the runtime, so they are read before it exists.
    let file = match command {
        Command::Run => match config::read(&cli.config) {
            Ok(file) => Some(file),
            Err(report) => {
                eprint!("{report}");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    let runtime = match runtime(file.as_ref().map(|f| &f.config.server)) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match command {
        Command::Check { against } => {
            runtime.block_on(cli::check::check(&cli.config, against.as_deref()))
        }
        Command::Run => match file {
            Some(file) => runtime.block_on(cli::run::run(&cli.config, file)),
            None => ExitCode::FAILURE,
        },
        Command::Healthcheck { url, timeout } => {
            runtime.block_on(cli::healthcheck::healthcheck(&cli.config, url, timeout))
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
            cli::replay::replay(&opts, format == "json")
        }
        Command::Caller {
            id,
            admin,
            token_file,
            json,
        } => runtime.block_on(cli::caller::caller(
            &cli.config,
            &id,
            admin,
            token_file,
            json,
        )),
        Command::Top { admin, n, once } => {
            runtime.block_on(cli::top::top(&cli.config, admin, n, once))
        }
    }
}

/// The async runtime a command runs on. For `run` with `server.runtime = "per_core"` it
/// is a current-thread runtime: the proxy listener gets its own worker threads
/// (`Gateway::start`), and this one only runs the admin listener, the reloader, the
/// store's background tasks and the signal handlers. Otherwise a multi-threaded one,
/// with `server.workers` threads when set.
fn runtime(server: Option<&ServerConfig>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match server.map(|s| s.runtime) {
        Some(RuntimeShape::PerCore) => tokio::runtime::Builder::new_current_thread(),
        _ => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = server.and_then(|s| s.workers).filter(|n| *n > 0) {
                builder.worker_threads(n);
            }
            builder
        }
    };
    builder.enable_all().build()
}
