//! Loading the config file: TOML → [`Config`] → problems reported as
//! `PATH:LINE:COLUMN: key.path: what is wrong`.
//!
//! Parsing is done by `toml` + serde (unknown keys and bad durations are serde errors);
//! semantic checks are made while the runtime snapshot is built
//! ([`crate::snapshot::Snapshot::build`]), which records each problem against a key path
//! such as `routes[1].limits[0]`. [`locate`] maps key paths and byte spans back to lines
//! and columns with `toml_edit`, which keeps the span of every key.

pub mod duration;
mod locate;
pub mod schema;

pub use duration::Dur;
pub use schema::*;

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

/// A URL fit for logs: `redis://user:secret@host` → `redis://user:<redacted>@host`, also
/// when the password itself holds `@` (the last `@` ends the userinfo), and the value of
/// a `password`, `pass` or `passwd` query parameter → `<redacted>`. Strings without a
/// password come back unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let mut out = match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:<redacted>@{host}")
        }
        None => format!("{scheme}://{rest}"),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _))
                    if ["password", "pass", "passwd"]
                        .iter()
                        .any(|s| k.eq_ignore_ascii_case(s)) =>
                {
                    format!("{k}=<redacted>")
                }
                _ => p.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

/// Parse `text` (read from `path`) into a [`Config`].
///
/// serde stops at the first error, so an unknown key is recorded, blanked out of a
/// working copy (spaces, so that every later error keeps its line and column), and the
/// parse tried again: a file with unknown keys still yields a [`ConfigFile`] whose
/// `problems` list them, and the semantic checks of [`crate::snapshot::Snapshot::build`]
/// run on the rest. Any other error (syntax, a bad value, a missing key) ends the parse:
/// the report holds it and every unknown key found before it.
pub fn parse(path: &Path, text: String) -> Result<ConfigFile, ConfigReport> {
    let parsed = |text, config, problems| ConfigFile {
        path: path.to_path_buf(),
        text,
        config,
        problems,
    };
    let mut error = match toml::from_str::<Config>(&text) {
        Ok(config) => return Ok(parsed(text, config, Problems::default())),
        Err(e) => e,
    };
    // Only a file with a problem is indexed and copied. Blanking a key keeps every other
    // key's byte offsets, so one index of the original text serves every round.
    let at = locate::Locator::new(&text);
    let mut work = text.clone();
    let mut problems = Problems::default();
    // One round (one parse) per unknown key, up to a cap: a file with thousands of them
    // costs MAX_UNKNOWN_KEYS parses, not one per key.
    for round in 1..=MAX_UNKNOWN_KEYS {
        let span = error.span();
        let key_path = span
            .as_ref()
            .map(|s| at.path_at(s.start))
            .unwrap_or_default();
        let message = error.message().trim().to_string();
        let unknown = message.starts_with("unknown field");
        let extent = if unknown { at.extent(&key_path) } else { None };
        problems.errors.push(Problem {
            path: key_path,
            message,
            span,
        });
        let Some(range) = extent else {
            break;
        };
        let blank: String = work[range.clone()]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        work.replace_range(range, &blank);
        if round == MAX_UNKNOWN_KEYS {
            problems.error(
                "",
                format!("more than {MAX_UNKNOWN_KEYS} unknown keys; the rest of the file was not checked"),
            );
            break;
        }
        error = match toml::from_str::<Config>(&work) {
            Ok(config) => return Ok(parsed(text, config, problems)),
            Err(e) => e,
        };
    }
    Err(ConfigReport {
        path: path.to_path_buf(),
        text,
        problems,
    })
}

/// How many unknown keys one parse reports before it gives up on the file.
pub const MAX_UNKNOWN_KEYS: usize = 50;

/// Read and parse the file at `path`.
pub fn read(path: &Path) -> Result<ConfigFile, ConfigReport> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(path, text),
        Err(e) => Err(ConfigReport::whole_file(
            path,
            format!("cannot read config file: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The errors of `text`: those that stopped the parse, or the skipped ones.
    fn report(text: &str) -> Vec<String> {
        match parse(Path::new("t.toml"), text.into()) {
            Err(report) => report.error_lines(),
            Ok(file) => ConfigReport {
                path: file.path,
                text: file.text,
                problems: file.problems,
            }
            .error_lines(),
        }
    }

    #[test]
    fn unknown_key_names_line_column_and_path() {
        let lines = report("[server]\nlisten = \"127.0.0.1:1\"\nlisten_port = 3\n");
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].starts_with("t.toml:3:1: server.listen_port: unknown field `listen_port`"),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn bad_duration_points_at_the_value() {
        let lines = report(
            "[[limits]]\nname = \"core\"\nwindow = \"5 parsecs\"\nquota = { anonymous = 1 }\n",
        );
        assert!(lines[0].starts_with("t.toml:3:"), "{}", lines[0]);
        assert!(
            lines[0].contains("limits[0].window: invalid duration"),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn syntax_error_has_a_location() {
        let lines = report("[server\nlisten = 1\n");
        assert!(lines[0].starts_with("t.toml:1:"), "{}", lines[0]);
    }
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
            "redis://h:1/0?password=<redacted>&db=2"
        );
        assert_eq!(
            redact_url("redis://h:1?pass=x"),
            "redis://h:1?pass=<redacted>"
        );
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("no url"), "no url");
    }
}
