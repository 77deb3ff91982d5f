//! Map key paths (`routes[1].limits[0]`) and byte offsets to lines and columns.

use super::Problem;
use std::collections::HashMap;
use std::ops::Range;
use toml_edit::{Document, Item, Table, Value};

/// Every key and array element of a document with its path and span.
fn entries(text: &str) -> Vec<(String, Range<usize>)> {
    let mut out = Vec::new();
    if let Ok(doc) = Document::parse(text) {
        walk_table(doc.as_table(), "", &mut out);
    }
    out
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

/// Every key of a document indexed once, so that locating many problems stays linear
/// in the file's size plus the number of problems (a file with 10,000 bad entries is
/// reported in one pass, not 10,000 parses).
pub(super) struct Locator<'a> {
    text: &'a str,
    /// Every key path with its span, in document order.
    entries: Vec<(String, Range<usize>)>,
    /// The start of each key path's first span.
    starts: HashMap<String, usize>,
    /// Each key path's first span.
    extents: HashMap<String, Range<usize>>,
    /// Indices into `entries`, ordered by span start.
    by_start: Vec<usize>,
    /// The byte offset where each line starts.
    line_starts: Vec<usize>,
}

impl<'a> Locator<'a> {
    /// Index `text` (one `toml_edit` parse; an unparsable text indexes no keys).
    pub(super) fn new(text: &'a str) -> Self {
        let entries = entries(text);
        let mut starts = HashMap::with_capacity(entries.len());
        let mut extents = HashMap::with_capacity(entries.len());
        for (p, s) in &entries {
            starts.entry(p.clone()).or_insert(s.start);
            extents.entry(p.clone()).or_insert_with(|| s.clone());
        }
        let mut by_start: Vec<usize> = (0..entries.len()).collect();
        // Stable: among equal starts, document order (parents first).
        by_start.sort_by_key(|&i| entries[i].1.start);
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Self {
            text,
            entries,
            starts,
            extents,
            by_start,
            line_starts,
        }
    }

    /// The key path of the smallest entry whose span holds `offset` ("" when none does).
    pub(super) fn path_at(&self, offset: usize) -> String {
        self.entries
            .iter()
            .filter(|(_, s)| s.start <= offset && offset < s.end.max(s.start + 1))
            .min_by_key(|(_, s)| s.end - s.start)
            .map(|(p, _)| p.clone())
            .unwrap_or_default()
    }

    /// The key path of the smallest entry whose span holds `offset`, looking only at
    /// entries that start within `within` (an `[[array]]` element): linear in the
    /// element's size, not the file's ("" when none does).
    pub(super) fn path_at_within(&self, offset: usize, within: &Range<usize>) -> String {
        // Entries are in document order; nested spans start later than their parent,
        // so the last entry starting at or before `offset` that holds it is the smallest.
        let end = self
            .by_start
            .partition_point(|&i| self.entries[i].1.start <= offset);
        self.by_start[..end]
            .iter()
            .rev()
            .take_while(|&&i| self.entries[i].1.start >= within.start)
            .map(|&i| &self.entries[i])
            .find(|(_, s)| offset < s.end.max(s.start + 1))
            .map(|(p, _)| p.clone())
            .unwrap_or_default()
    }

    /// The byte range of the key `path` together with its value (`colour = "blue"`).
    pub(super) fn extent(&self, path: &str) -> Option<Range<usize>> {
        self.extents.get(path).cloned()
    }

    /// Whether the key at `range` starts its line (a `key = value` line of a table, not
    /// a member of an inline table or an array): blanking it leaves valid TOML.
    pub(super) fn starts_line(&self, range: &Range<usize>) -> bool {
        let before = &self.text[..range.start.min(self.text.len())];
        let line = before.rsplit('\n').next().unwrap_or("");
        line.trim().is_empty()
    }

    /// The byte offset where `path` (or its nearest ancestor present in the file) starts.
    fn offset_of(&self, path: &str) -> Option<usize> {
        let mut p = path;
        loop {
            if let Some(s) = self.starts.get(p) {
                return Some(*s);
            }
            // Drop the last `.key` or `[i]`.
            let cut = p.rfind(['.', '['])?;
            p = &p[..cut];
        }
    }

    /// 1-based line and column of a problem.
    pub(super) fn line_col(&self, p: &Problem) -> (usize, usize) {
        let text = self.text;
        let offset = p
            .span
            .as_ref()
            .map(|s| s.start)
            .or_else(|| self.offset_of(&p.path))
            .unwrap_or(0)
            .min(text.len());
        let offset = floor_char_boundary(text, offset);
        let line = self.line_starts.partition_point(|&start| start <= offset);
        let start = self.line_starts[line - 1];
        (line, text[start..offset].chars().count() + 1)
    }
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
        let at = Locator::new(text);
        assert_eq!(at.line_col(&p), (3, 16));
        let p = Problem {
            path: "routes[0].missing".into(),
            message: String::new(),
            span: None,
        };
        assert_eq!(at.line_col(&p).0, 1);
        assert_eq!(
            at.path_at(text.find("\"b\"").unwrap()),
            "routes[0].limits[1]"
        );
        let p = Problem {
            path: String::new(),
            message: String::new(),
            span: Some(text.len()..text.len()),
        };
        assert_eq!(at.line_col(&p), (4, 1));
    }
}
