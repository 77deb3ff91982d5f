//! `tollgate check`: parse and validate a config file as the gateway would, touch
//! nothing.

use std::path::Path;
use std::process::ExitCode;
use tollgate::config;
use tollgate::config::validate::reshard_warning;
use tollgate::snapshot::Snapshot;

/// `tollgate check`: every error as `PATH:LINE:COLUMN: key.path: message`.
pub(crate) async fn check(path: &Path, against: Option<&Path>) -> ExitCode {
    let built = config::read(path).and_then(|file| {
        let files = tollgate::load::Loaded::load(&file, None);
        Snapshot::build(&file, &files, None)
    });
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
