//! `tollgate replay`: decide the requests of access logs with a config, offline.

use std::process::ExitCode;

/// `tollgate replay`: the report on stdout; exit 1 when a config or a log cannot be read.
pub(crate) fn replay(opts: &tollgate::replay::Options, json: bool) -> ExitCode {
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
