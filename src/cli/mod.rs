//! The `tollgate` command line: its arguments, and one module per subcommand.

pub(crate) mod caller;
pub(crate) mod check;
pub(crate) mod healthcheck;
pub(crate) mod key;
pub(crate) mod replay;
pub(crate) mod run;
pub(crate) mod top;

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tollgate::config;

/// The command line.
#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting reverse proxy",
    after_help = CONFIG_REFERENCE
)]
pub(crate) struct Cli {
    /// Config file. Default: $TOLLGATE_CONFIG, then /etc/tollgate/tollgate.toml.
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_CONFIG",
        default_value = "/etc/tollgate/tollgate.toml"
    )]
    pub(crate) config: PathBuf,
    /// What to do; default `run`.
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
}

/// Where `--help` sends a reader for the config keys.
const CONFIG_REFERENCE: &str =
    "The config file is TOML; docs/configuration.md (in tollgate's source) is the full \
reference of its keys: type, default, rules and when a change takes effect.";

/// The subcommands.
#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// One caller's limits now: GET /callers/{id} of a running gateway (read from the
    /// store, nothing charged). Needs the admin token, in $TOLLGATE_ADMIN_TOKEN or
    /// --token-file.
    Caller {
        /// A client id, or an anonymous caller's address or its keyed hash (as
        /// `tollgate top` shows it).
        id: String,
        /// The admin listener, HOST:PORT. Default: the config's `server.admin_listen`.
        #[arg(long, value_name = "ADDR")]
        admin: Option<String>,
        /// A file holding the admin token (the token whose SHA-256 is
        /// `server.admin_token_sha256`). Default: $TOLLGATE_ADMIN_TOKEN.
        #[arg(long, value_name = "PATH")]
        token_file: Option<PathBuf>,
        /// Print the JSON answer (pretty) instead of a table.
        #[arg(long)]
        json: bool,
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

/// `tollgate key ...`.
#[derive(Subcommand)]
pub(crate) enum KeyCommand {
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

fn parse_duration(s: &str) -> Result<Duration, String> {
    config::duration::parse_duration(s)
}

/// `server.admin_listen` of the config at `path`, for `tollgate COMMAND` when `FLAG` was
/// not given. Errors (printed): the file cannot be used, or it sets no admin listener.
fn admin_listen(path: &Path, command: &str, flag: &str) -> Result<String, ExitCode> {
    match config::read(path) {
        Ok(file) => match file.config.server.admin_listen {
            Some(a) => Ok(a),
            None => {
                eprintln!(
                    "tollgate {command}: {}: server.admin_listen is not set; pass {flag}",
                    path.display()
                );
                Err(ExitCode::FAILURE)
            }
        },
        Err(report) => {
            eprint!("{report}");
            Err(ExitCode::FAILURE)
        }
    }
}
