//! docs/ARCHITECTURE.md's "Files over 600 lines" lists exactly the Rust
//! files of `src/` and `python/src/` that are over 600 lines: a file that
//! grows past the mark must say there why it is one concern, and a row
//! whose file shrank goes. The table holds no line counts (they drift); this
//! test is what keeps the list itself true.

use std::path::{Path, PathBuf};

const LIMIT: usize = 600;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The names in the first cell of each row of the section's table (a name
/// may be a path's tail, `bench/pin.rs`, as the docs shorten them).
fn listed(doc: &str) -> Vec<String> {
    let section = doc.split("## Files over 600 lines").nth(1).expect("docs/ARCHITECTURE.md has the section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .flat_map(|l| {
            let first = l.trim_start_matches('|').split('|').next().unwrap_or("");
            first.split('`').skip(1).step_by(2).map(str::to_owned).collect::<Vec<_>>()
        })
        .collect()
}

/// The files over the limit that no listed name matches, and the listed
/// names that match no file over the limit.
fn mismatches(big: &[String], names: &[String]) -> (Vec<String>, Vec<String>) {
    let matches = |f: &str, n: &str| f == n || f.ends_with(&format!("/{n}"));
    let unlisted = big.iter().filter(|f| !names.iter().any(|n| matches(f, n))).cloned().collect();
    let stale = names.iter().filter(|n| !big.iter().any(|f| matches(f, n))).cloned().collect();
    (unlisted, stale)
}

#[test]
fn the_table_lists_exactly_the_files_over_600_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("python/src"), &mut files);
    let mut big: Vec<String> = files
        .iter()
        .filter(|p| std::fs::read_to_string(p).map(|s| s.lines().count()).unwrap_or(0) > LIMIT)
        .map(|p| p.strip_prefix(root).expect("under the root").to_string_lossy().into_owned())
        .collect();
    big.sort();
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let (unlisted, stale) = mismatches(&big, &listed(&doc));
    assert!(
        unlisted.is_empty() && stale.is_empty(),
        "docs/ARCHITECTURE.md, \"Files over 600 lines\": over {LIMIT} lines but not listed (say why each is one concern): {unlisted:?}; listed but not over {LIMIT} lines (remove the row): {stale:?}"
    );
}

/// The check can fail, both ways: a file over the mark missing from the
/// table, and a row whose file is no longer over it.
#[test]
fn the_check_catches_a_missing_and_a_stale_row() {
    let doc = "## Files over 600 lines\n\n| file | why |\n|---|---|\n| `src/a.rs`, `bench/b.rs` | x |\n| `src/gone.rs` | y |\n\n## Next\n| `src/c.rs` | not this section |\n";
    let names = listed(doc);
    assert_eq!(names, ["src/a.rs", "bench/b.rs", "src/gone.rs"]);
    let big = vec!["src/a.rs".to_owned(), "src/bin/bench/b.rs".to_owned(), "src/new.rs".to_owned()];
    let (unlisted, stale) = mismatches(&big, &names);
    assert_eq!(unlisted, ["src/new.rs"]);
    assert_eq!(stale, ["src/gone.rs"]);
}
