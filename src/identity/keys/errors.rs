//! The problems of a key set that could not be built, each tied to an inline entry's
//! key path or to a line of the keys file.

use crate::config::MAX_REPORTED;
use std::path::{Path, PathBuf};

/// A problem in the keys: at an inline entry, or at a line of the keys file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyProblem {
    /// At a key path of the config file, e.g. `identity.clients[2].key_sha256`.
    Config {
        /// The key path.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// At a line of the keys file (0: the file as a whole).
    File {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// The problems of a key set that could not be built: those of inline entries (the
/// config report caps them), at most [`MAX_REPORTED`] of the keys file, and how many
/// more the file had.
#[derive(Debug, Clone, Default)]
pub struct KeyErrors {
    /// The keys file, for rendering.
    pub file: Option<PathBuf>,
    /// The problems kept.
    pub problems: Vec<KeyProblem>,
    /// Problems of the keys file kept.
    file_problems: usize,
    /// Problems of the keys file found past [`MAX_REPORTED`].
    pub more: usize,
    /// A problem must name where something was given earlier, and this build did not
    /// keep it: the set is built again keeping it (the problems are not reported).
    pub(super) untracked: bool,
}

impl KeyErrors {
    /// No problems yet, of the keys file `file`.
    pub(super) fn of(file: Option<PathBuf>) -> Self {
        Self {
            file,
            ..Self::default()
        }
    }

    /// The keys file `file` was not read before the config was built (a [`Files`] made
    /// for another config or another previous snapshot).
    ///
    /// [`Files`]: crate::config::Files
    pub fn not_read(file: &Path) -> Self {
        let mut errors = Self::of(Some(file.to_path_buf()));
        errors.file(
            0,
            "the keys file was not read before the config was built (a bug)".into(),
        );
        errors
    }

    pub(super) fn push(&mut self, p: KeyProblem) {
        if matches!(p, KeyProblem::Config { .. }) {
            self.problems.push(p);
        } else if self.file_problems < MAX_REPORTED {
            self.file_problems += 1;
            self.problems.push(p);
        } else {
            self.more += 1;
        }
    }

    pub(super) fn file(&mut self, line: usize, message: String) {
        self.push(KeyProblem::File { line, message });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.problems.is_empty()
    }

    /// A problem of the keys file as `PATH:LINE: what is wrong` (`PATH: …` for the
    /// file as a whole, line 0).
    pub fn file_line(&self, line: usize, message: &str) -> String {
        let path = self.file.as_deref().unwrap_or(Path::new("")).display();
        match line {
            0 => format!("{path}: {message}"),
            n => format!("{path}:{n}: {message}"),
        }
    }

    /// The count of problems not shown, as a line (`None` when all are shown).
    pub fn more_line(&self) -> Option<String> {
        (self.more > 0).then(|| self.file_line(0, &format!("{} more errors not shown", self.more)))
    }

    /// Each problem as one line: `PATH:LINE: what is wrong` for the keys file,
    /// `key.path: what is wrong` for inline entries, then a count of those not shown.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .problems
            .iter()
            .map(|p| match p {
                KeyProblem::Config { path, message } => format!("{path}: {message}"),
                KeyProblem::File { line, message } => self.file_line(*line, message),
            })
            .collect();
        out.extend(self.more_line());
        out
    }
}
