//! The config file: its schema ([`schema`], with the string choices in [`choices`]),
//! reading it ([`read`], [`parse`]: TOML → [`Config`]), reading every file it names
//! ([`files`]: the loading step, before a snapshot is built), the rules that are not
//! types ([`validate`]), and problems reported as
//! `PATH:LINE:COLUMN: key.path: what is wrong`.
//!
//! Parsing is done by `toml` + serde (unknown keys, bad durations and bad choices are
//! serde errors, located by their span); the other rules record each problem against a
//! key path such as `routes[1].limits[0]`, while the runtime snapshot is built
//! ([`crate::snapshot::Snapshot::build`]). `locate` maps key paths and byte spans back
//! to lines and columns with `toml_edit`, which keeps the span of every key.

pub mod choices;
pub mod duration;
pub mod files;
mod locate;
mod parse;
pub mod schema;
pub mod secrets;
pub mod trace;
pub mod validate;

pub use choices::{ChargeAt, LimitBy, LimitMode, OnLimit, PathMatch, WindowAlign};
pub use duration::Dur;
pub use files::Files;
pub use parse::{parse, read, MAX_UNKNOWN_KEYS, REFERENCE_HINT};
pub use schema::*;
pub use trace::{TracingConfig, TrustIncoming};

use std::fmt;
use std::path::{Path, PathBuf};

/// One thing wrong (or worth a warning) in a config file, tied to a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path with indices, e.g. `routes[1].limits[0]`; empty for the whole file.
    pub path: String,
    /// What is wrong, for a human.
    pub message: String,
    /// Byte span in the file when known directly (parse errors); otherwise located by `path`.
    pub span: Option<std::ops::Range<usize>>,
}

/// Errors and warnings gathered while validating a config.
#[derive(Debug, Clone, Default)]
pub struct Problems {
    /// Problems that make the config unusable.
    pub errors: Vec<Problem>,
    /// Problems worth telling the operator about that do not stop the config.
    pub warnings: Vec<Problem>,
}

impl Problems {
    /// Record an error at `path`.
    pub fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Problem {
            path: path.into(),
            message: message.into(),
            span: None,
        });
    }

    /// Record a warning at `path`.
    pub fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Problem {
            path: path.into(),
            message: message.into(),
            span: None,
        });
    }

    /// True when no error was recorded.
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// A config file as read from disk: its path, its text and the parsed [`Config`].
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// Where it was read from (as given).
    pub path: PathBuf,
    /// The file's text, kept to locate problems.
    pub text: String,
    /// The parsed config.
    pub config: Config,
    /// Errors found while parsing that did not stop it (unknown keys, which were
    /// skipped): a snapshot built from this file reports them with its own findings
    /// and is refused.
    pub problems: Problems,
}

/// A config file that could not be used, with every problem found.
#[derive(Debug, Clone)]
pub struct ConfigReport {
    /// The file's path, printed at the start of every line.
    pub path: PathBuf,
    /// The file's text ("" when it could not be read).
    pub text: String,
    /// Errors and warnings.
    pub problems: Problems,
}

impl ConfigReport {
    /// A report about a file that was never parsed (e.g. unreadable).
    pub fn whole_file(path: &Path, message: String) -> Self {
        let mut problems = Problems::default();
        problems.error("", message);
        Self {
            path: path.to_path_buf(),
            text: String::new(),
            problems,
        }
    }

    /// Render one problem as `PATH:LINE:COLUMN: key.path: message`.
    fn render(&self, at: &locate::Locator<'_>, p: &Problem) -> String {
        let (line, col) = at.line_col(p);
        let key = if p.path.is_empty() { "(file)" } else { &p.path };
        format!(
            "{}:{}:{}: {}: {}",
            self.path.display(),
            line,
            col,
            key,
            p.message
        )
    }

    /// Render at most `max` of `problems` (after `prefix`), then one line saying how
    /// many more there are. One index of the file serves every line, so the cost is
    /// linear in the file's size and the number of lines printed.
    fn lines(&self, problems: &[Problem], prefix: &str, what: &str, max: usize) -> Vec<String> {
        if problems.is_empty() {
            return Vec::new();
        }
        let at = locate::Locator::new(&self.text);
        let mut out: Vec<String> = problems
            .iter()
            .take(max)
            .map(|p| format!("{prefix}{}", self.render(&at, p)))
            .collect();
        if problems.len() > max {
            out.push(format!(
                "{}: {} more {what} not shown (fix those above and run `tollgate check` again)",
                self.path.display(),
                problems.len() - max
            ));
        }
        out
    }

    /// The errors, one rendered line each: the first [`MAX_REPORTED`], then a line
    /// counting the rest.
    pub fn error_lines(&self) -> Vec<String> {
        self.lines(&self.problems.errors, "", "errors", MAX_REPORTED)
    }

    /// The warnings, one rendered line each (prefixed `warning: `), capped like
    /// [`ConfigReport::error_lines`].
    pub fn warning_lines(&self) -> Vec<String> {
        self.lines(
            &self.problems.warnings,
            "warning: ",
            "warnings",
            MAX_REPORTED,
        )
    }
}

/// How many errors (and, separately, warnings) a report prints; a file with thousands
/// of bad entries gets this many lines and a count of the rest.
pub const MAX_REPORTED: usize = 100;

impl fmt::Display for ConfigReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for line in self.error_lines() {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigReport {}

/// A URL fit for logs and `GET /config`: the user info's password (or the whole user
/// info when it has no `:`, which is then a token) and the value of every query
/// parameter are replaced by `<redacted>`: `redis://user:secret@host` →
/// `redis://user:<redacted>@host` (also when the password itself holds `@`: the last
/// `@` ends the user info), `http://TOKEN@host/` → `http://<redacted>@host/`,
/// `http://host/auth?token=t&v=2` → `http://host/auth?token=<redacted>&v=<redacted>`.
/// Strings without user info or a query come back unchanged.
pub fn redact_url(url: &str) -> String {
    const HIDDEN: &str = "<redacted>";
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let mut out = match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:{HIDDEN}@{host}"),
            None => format!("{scheme}://{HIDDEN}@{host}"),
        },
        None => format!("{scheme}://{rest}"),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) => format!("{k}={HIDDEN}"),
                // A bare word may be a token too.
                None if !p.is_empty() => HIDDEN.to_string(),
                None => String::new(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn passwords_never_show() {
        assert_eq!(redact_url("redis://u:p@h:1"), "redis://u:<redacted>@h:1");
        assert_eq!(
            redact_url("redis://:p@ss@h:1/0"),
            "redis://:<redacted>@h:1/0"
        );
        assert_eq!(
            redact_url("redis://h:1/0?password=s3cret&db=2"),
            "redis://h:1/0?password=<redacted>&db=<redacted>"
        );
        assert_eq!(
            redact_url("http://127.0.0.1:9100/auth?token=t0k&v=2&bare"),
            "http://127.0.0.1:9100/auth?token=<redacted>&v=<redacted>&<redacted>"
        );
        assert_eq!(
            redact_url("http://t0k3n@127.0.0.1:9100/auth"),
            "http://<redacted>@127.0.0.1:9100/auth"
        );
        assert_eq!(
            redact_url("redis://h:1?pass=x"),
            "redis://h:1?pass=<redacted>"
        );
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("no url"), "no url");
    }
}
