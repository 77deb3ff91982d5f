//! Map key paths (`routes[1].limits[0]`) and byte offsets to lines and columns.

use super::Problem;
use std::ops::Range;
use std::path::Path;
use toml_edit::{Document, Item, Table, Value};

/// Every key and array element of a document with its path and span.
fn entries(text: &str) -> Vec<(String, Range<usize>)> {
    let mut out = Vec::new();
    if let Ok(doc) = Document::parse(text) {
        walk_table(doc.as_table(), "", &mut out);
    }
    out
}

/// The byte range of the key `path` together with its value (`colour = "blue"`), when
/// the document parses and holds it.
pub(super) fn extent(text: &str, path: &str) -> Option<Range<usize>> {
    entries(text)
        .into_iter()
        .find(|(p, _)| p == path)
        .map(|(_, span)| span)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn union(a: Option<Range<usize>>, b: Option<Range<usize>>) -> Option<Range<usize>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.start.min(b.start)..a.end.max(b.end)),
        (a, b) => a.or(b),
    }
}

fn walk_table(t: &Table, path: &str, out: &mut Vec<(String, Range<usize>)>) {
    if let Some(span) = t.span() {
        if !path.is_empty() {
            out.push((path.to_string(), span));
        }
    }
    for (k, item) in t.iter() {
        let p = join(path, k);
        let key_span = t.key(k).and_then(|k| k.span());
        if let Some(span) = union(key_span, item.span()) {
            out.push((p.clone(), span));
        }
        walk_item(item, &p, out);
    }
}

fn walk_item(item: &Item, path: &str, out: &mut Vec<(String, Range<usize>)>) {
    match item {
        Item::Table(t) => walk_table(t, path, out),
        Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                walk_table(t, &format!("{path}[{i}]"), out);
            }
        }
        Item::Value(v) => walk_value(v, path, out),
        Item::None => {}
    }
}

fn walk_value(v: &Value, path: &str, out: &mut Vec<(String, Range<usize>)>) {
    match v {
        Value::InlineTable(t) => {
            for (k, item) in t.iter() {
                let p = join(path, k);
                let key_span = t.key(k).and_then(|k| k.span());
                if let Some(span) = union(key_span, item.span()) {
                    out.push((p.clone(), span));
                }
                walk_value(item, &p, out);
            }
        }
        Value::Array(a) => {
            for (i, item) in a.iter().enumerate() {
                let p = format!("{path}[{i}]");
                if let Some(span) = item.span() {
                    out.push((p.clone(), span));
                }
                walk_value(item, &p, out);
            }
        }
        _ => {}
    }
}

/// The key path of the smallest entry whose span holds `offset` ("" when none does).
pub(super) fn path_at(text: &str, offset: usize) -> String {
    entries(text)
        .into_iter()
        .filter(|(_, s)| s.start <= offset && offset < s.end.max(s.start + 1))
        .min_by_key(|(_, s)| s.end - s.start)
        .map(|(p, _)| p)
        .unwrap_or_default()
}

/// The byte offset where `path` (or its nearest ancestor present in the file) starts.
fn offset_of(text: &str, path: &str) -> Option<usize> {
    let all = entries(text);
    let mut p = path.to_string();
    loop {
        if let Some((_, s)) = all.iter().find(|(q, _)| *q == p) {
            return Some(s.start);
        }
        // Drop the last `.key` or `[i]`.
        let cut = p.rfind(['.', '['])?;
        p.truncate(cut);
    }
}

/// 1-based line and column of a problem in `text`.
pub(super) fn line_col(text: &str, p: &Problem, _file: &Path) -> (usize, usize) {
    let offset = p
        .span
        .as_ref()
        .map(|s| s.start)
        .or_else(|| offset_of(text, &p.path))
        .unwrap_or(0)
        .min(text.len());
    let before = &text[..floor_char_boundary(text, offset)];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_paths() {
        let text = "[[routes]]\npath_prefix = \"/\"\nlimits = [\"a\", \"b\"]\n";
        let p = Problem {
            path: "routes[0].limits[1]".into(),
            message: String::new(),
            span: None,
        };
        assert_eq!(line_col(text, &p, Path::new("x")), (3, 16));
        let p = Problem {
            path: "routes[0].missing".into(),
            message: String::new(),
            span: None,
        };
        assert_eq!(line_col(text, &p, Path::new("x")).0, 1);
        assert_eq!(
            path_at(text, text.find("\"b\"").unwrap()),
            "routes[0].limits[1]"
        );
    }
}
