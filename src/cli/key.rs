//! `tollgate key new`: make an API key for `identity.clients_file`.

use std::path::Path;
use std::process::ExitCode;

/// `tollgate key new`: the key on the first line of stdout, the JSON line on the second.
pub(crate) fn key_new(id: &str, tier: &str, label: Option<&str>, file: Option<&Path>) -> ExitCode {
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
