//! Reading a config file: TOML → [`Config`], every problem found with its line and
//! column, in time linear in the file's size.

use super::{locate, Config, ConfigFile, ConfigReport, Problem, Problems};
use std::path::Path;

/// Parse `text` (read from `path`) into a [`Config`].
///
/// serde stops at the first error, so a file that does not parse is checked in parts,
/// to report every problem with its line and column in time linear in the file's size:
/// each element of an array of tables (`[[limits]]`, `[[routes]]`,
/// `[[identity.clients]]`, ...) is parsed on its own, then the rest of the file with
/// those elements blanked out. Within a part, a key with a problem (unknown, or a bad
/// value) is recorded, blanked out of a working copy (spaces, so that every later error
/// keeps its line and column), and the part parsed again. When the only problems are
/// unknown keys, the file still yields a [`ConfigFile`] whose `problems` list them, and
/// the semantic checks of [`crate::snapshot::Snapshot::build`] run on the rest. A syntax
/// error ends the parse.
pub fn parse(path: &Path, text: String) -> Result<ConfigFile, ConfigReport> {
    let parsed = |text, config, problems| ConfigFile {
        path: path.to_path_buf(),
        text,
        config,
        problems,
    };
    let error = match toml::from_str::<Config>(&text) {
        Ok(config) => return Ok(parsed(text, config, Problems::default())),
        Err(e) => e,
    };
    let report = |text, problems| ConfigReport {
        path: path.to_path_buf(),
        text,
        problems,
    };
    let Ok(doc) = toml_edit::Document::parse(text.as_str()) else {
        // A syntax error: nothing else can be trusted.
        let mut problems = Problems::default();
        problems.errors.push(Problem {
            path: String::new(),
            message: error.message().trim().to_string(),
            span: error.span(),
        });
        return Err(report(text, problems));
    };
    // Only a file with a problem is indexed and copied. Blanking a key keeps every other
    // key's byte offsets, so one index of the original text serves every part.
    let at = locate::Locator::new(&text);
    let mut problems = Problems::default();
    let mut blanked: Vec<std::ops::Range<usize>> = Vec::new();
    let mut rest = text.clone();
    for unit in array_elements(&doc, text.len()) {
        let mut work = text[unit.clone()].to_string();
        check_part(
            &mut work,
            unit.start,
            &unit,
            &at,
            &mut problems,
            &mut blanked,
        );
        blank(&mut rest, unit.clone());
    }
    let whole = 0..text.len();
    check_part(&mut rest, 0, &whole, &at, &mut problems, &mut blanked);
    let only_unknown = problems
        .errors
        .iter()
        .all(|p| p.message.starts_with("unknown field"));
    if problems.errors.is_empty() || only_unknown {
        // Parse the whole file without its unknown keys.
        let mut work = text.clone();
        for range in &blanked {
            blank(&mut work, range.clone());
        }
        match toml::from_str::<Config>(&work) {
            Ok(config) if !problems.errors.is_empty() => return Ok(parsed(text, config, problems)),
            Ok(_) => {}
            Err(e) => {
                let span = e.span();
                problems.errors.push(Problem {
                    path: span
                        .as_ref()
                        .map(|s| at.path_at(s.start))
                        .unwrap_or_default(),
                    message: e.message().trim().to_string(),
                    span,
                });
            }
        }
        if problems.errors.is_empty() {
            // Only the whole file shows it (e.g. a key defined in two parts).
            let span = error.span();
            problems.errors.push(Problem {
                path: span
                    .as_ref()
                    .map(|s| at.path_at(s.start))
                    .unwrap_or_default(),
                message: error.message().trim().to_string(),
                span,
            });
        }
    }
    // In file order, whatever part found them.
    problems
        .errors
        .sort_by_key(|p| p.span.as_ref().map_or(usize::MAX, |s| s.start));
    Err(report(text, problems))
}

/// Replace `range` of `work` with spaces, keeping its newlines (so lines and columns
/// stay where they were).
fn blank(work: &mut String, range: std::ops::Range<usize>) {
    // One space per byte (not per character): every later byte offset stays valid.
    let blank: String = work[range.clone()]
        .chars()
        .flat_map(|c| {
            let n = if c == '\n' { 0 } else { c.len_utf8() };
            std::iter::repeat_n(' ', n).chain((c == '\n').then_some('\n'))
        })
        .collect();
    work.replace_range(range, &blank);
}

/// Parse one part of the file (`work`, the file's bytes `part` blanked in places, which
/// starts at byte `offset` of the file) until it parses or a problem cannot be blanked
/// out: each key with a problem is recorded, blanked (its range added to `blanked`) and
/// the part parsed again. A required key missing because it was blanked is not
/// reported again. At most [`MAX_UNKNOWN_KEYS`] rounds per part.
fn check_part(
    work: &mut String,
    offset: usize,
    part: &std::ops::Range<usize>,
    at: &locate::Locator<'_>,
    problems: &mut Problems,
    blanked: &mut Vec<std::ops::Range<usize>>,
) {
    let first_blanked = blanked.len();
    for round in 1..=MAX_UNKNOWN_KEYS {
        let e = match toml::from_str::<Config>(work) {
            Ok(_) => return,
            Err(e) => e,
        };
        let span = e.span().map(|s| s.start + offset..s.end + offset);
        let key_path = span
            .as_ref()
            .map(|s| at.path_at_within(s.start, part))
            .unwrap_or_default();
        let message = e.message().trim().to_string();
        if let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|m| m.split('`').next())
        {
            let missing = if key_path.is_empty() {
                field.to_string()
            } else {
                format!("{key_path}.{field}")
            };
            let ours = blanked[first_blanked..]
                .iter()
                .any(|r| at.path_at_within(r.start, part) == missing);
            if !ours {
                problems.errors.push(Problem {
                    path: key_path,
                    message,
                    span,
                });
            }
            return;
        }
        // Blank the key itself, or (inside an inline table or an array) the nearest
        // enclosing key that starts its line, so that the rest stays valid TOML.
        let mut target = key_path.as_str();
        let extent = loop {
            match at.extent(target) {
                Some(r) if at.starts_line(&r) => break Some(r),
                _ => match target.rfind(['.', '[']) {
                    Some(cut) => target = &target[..cut],
                    None => break None,
                },
            }
        };
        let message = if message.starts_with("unknown field") {
            format!("{message}; {REFERENCE_HINT}")
        } else {
            message
        };
        problems.errors.push(Problem {
            path: key_path.clone(),
            message,
            span,
        });
        let Some(range) = extent.filter(|r| r.start >= part.start && r.end <= part.end) else {
            return;
        };
        blank(work, range.start - offset..range.end - offset);
        blanked.push(range);
        if round == MAX_UNKNOWN_KEYS {
            problems.error(
                key_path,
                format!("more than {MAX_UNKNOWN_KEYS} problems here; the rest of this part was not checked"),
            );
        }
    }
}

/// The byte ranges of the elements of every array of tables that is not inside
/// another one (`[[limits]]`, `[[identity.clients]]`, `[[store.shards]]`), each from its
/// header to the next header that is not its own sub-table, in file order.
fn array_elements(doc: &toml_edit::Document<&str>, len: usize) -> Vec<std::ops::Range<usize>> {
    // Every header: its start, its dotted name, and whether it opens an element.
    fn walk(t: &toml_edit::Table, path: &str, out: &mut Vec<(usize, String, bool)>) {
        for (k, item) in t.iter() {
            let p = if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            };
            match item {
                toml_edit::Item::Table(sub) => {
                    if let (false, false, Some(span)) =
                        (sub.is_implicit(), sub.is_dotted(), sub.span())
                    {
                        out.push((span.start, p.clone(), false));
                    }
                    walk(sub, &p, out);
                }
                toml_edit::Item::ArrayOfTables(a) => {
                    for el in a.iter() {
                        if let Some(span) = el.span() {
                            out.push((span.start, p.clone(), true));
                        }
                        walk(el, &p, out);
                    }
                }
                _ => {}
            }
        }
    }
    let mut headers = Vec::new();
    walk(doc.as_table(), "", &mut headers);
    headers.sort_by_key(|h| h.0);
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, (start, name, element)) in headers.iter().enumerate() {
        if !element || out.last().is_some_and(|r| r.end > *start) {
            continue;
        }
        let prefix = format!("{name}.");
        let end = headers[i + 1..]
            .iter()
            .find(|(_, n, _)| !n.starts_with(&prefix))
            .map_or(len, |h| h.0);
        out.push(*start..end);
    }
    out
}

/// Appended to an unknown key's error: where every key is described.
pub const REFERENCE_HINT: &str =
    "docs/configuration.md (in tollgate's source) lists every key, with its type, default and rules";

/// How many problems one part of a file (an `[[array]]` element, or the rest of the
/// file) reports before the check gives up on that part.
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
    fn blanking_keeps_byte_offsets_past_multibyte_characters() {
        let lines = report(
            "[[limits]]\nname = \"café\"\nwindow = \"zz\"\nquota = { anonymous = -1 }\ncolour = \"é\"\n[server]\nlisten = 1\n",
        );
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(
            lines[3].starts_with("t.toml:7:10: server.listen"),
            "{lines:?}"
        );
    }

    #[test]
    fn syntax_error_has_a_location() {
        let lines = report("[server\nlisten = 1\n");
        assert!(lines[0].starts_with("t.toml:1:"), "{}", lines[0]);
    }
}
