//! The documentation's own checks: every relative link and `#anchor` in the Markdown resolves
//! (as GitHub and mdBook make heading anchors), the guide's chapters are all in `SUMMARY.md` and
//! all doctested, the `#[py_op]` options table and every other table row are written once, the
//! README stays short, the guide's copy of the set-up blocks is the README's, and step 4 of the
//! set-up makes the venv with the interpreter the build uses.
//!
//! Plain std, no Python and no pyop: these run in a second.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

mod common;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `path` relative to the repository, with `/` separators, for messages and comparisons.
fn rel(path: &Path) -> String {
    let path = path.strip_prefix(repo()).unwrap_or(path);
    let parts: Vec<String> = path
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    parts.join("/")
}

/// The files under `dir` whose name ends with `ext`, sorted.
fn files_under(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.to_string_lossy().ends_with(ext) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The guide's chapters: every Markdown file under `docs/src` but `SUMMARY.md`.
fn chapters() -> Vec<PathBuf> {
    let src = repo().join("docs/src");
    files_under(&src, ".md")
        .into_iter()
        .filter(|p| p != &src.join("SUMMARY.md"))
        .collect()
}

/// Every Markdown file whose links are checked: the repository's top-level documents, the test
/// map, and the guide (its `SUMMARY.md` included).
fn markdown_files() -> Vec<PathBuf> {
    let top = [
        "README.md",
        "CONTRIBUTING.md",
        "ARCHITECTURE.md",
        "CHANGELOG.md",
    ];
    let mut files: Vec<PathBuf> = top.iter().map(|f| repo().join(f)).collect();
    files.push(repo().join("tests/README.md"));
    files.extend(files_under(&repo().join("docs/src"), ".md"));
    files
}

/// A Markdown line, as the checks see it.
struct Line<'a> {
    number: usize,
    text: &'a str,
    /// Inside a fenced code block (the fences themselves included).
    code: bool,
}

/// The lines of a Markdown text, each marked as code (fenced blocks, fences included) or not.
/// HTML comments are left out.
fn lines(text: &str) -> Vec<Line<'_>> {
    let mut out = Vec::new();
    let mut fence: Option<usize> = None;
    let mut comment = false;
    for (i, text) in text.lines().enumerate() {
        let trimmed = text.trim_start();
        if fence.is_none() && (comment || trimmed.starts_with("<!--")) {
            comment = !text.contains("-->");
            continue;
        }
        let ticks = trimmed.chars().take_while(|&c| c == '`').count();
        let code = match fence {
            Some(open) if ticks >= open && trimmed[ticks..].trim().is_empty() => {
                fence = None;
                true
            }
            Some(_) => true,
            None if ticks >= 3 => {
                fence = Some(ticks);
                true
            }
            None => false,
        };
        out.push(Line {
            number: i + 1,
            text,
            code,
        });
    }
    out
}

/// The info string of each opening fence (`rust,no_run`, `sh`, …), with its line number.
fn fences(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut open = false;
    for line in lines(text) {
        let trimmed = line.text.trim_start();
        if line.code && trimmed.starts_with("```") {
            if !open {
                out.push((
                    line.number,
                    trimmed.trim_start_matches('`').trim().to_owned(),
                ));
            }
            open = !open;
        }
    }
    out
}

/// `text` without its inline code spans (a link written inside one is not a link).
fn without_code_spans(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('`') {
        out.push_str(&rest[..at]);
        let run = rest[at..].chars().take_while(|&c| c == '`').count();
        let after = &rest[at + run..];
        let closing = "`".repeat(run);
        match after.find(&closing) {
            Some(end) => rest = &after[end + run..],
            None => {
                out.push_str(&rest[at..at + run]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The destinations of the inline links (`[text](dest)`, images too) and of the reference
/// definitions (`[label]: dest`) of a Markdown text, with their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for line in lines(text).into_iter().filter(|l| !l.code) {
        let plain = without_code_spans(line.text);
        let trimmed = plain.trim_start();
        if trimmed.starts_with('[') {
            if let Some(end) = trimmed.find("]:") {
                let dest = trimmed[end + 2..].split_whitespace().next().unwrap_or("");
                out.push((line.number, dest.trim_matches(['<', '>']).to_owned()));
                continue;
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let mut depth = 0;
            let end = after
                .char_indices()
                .find(|&(_, c)| match c {
                    '(' => {
                        depth += 1;
                        false
                    }
                    ')' if depth == 0 => true,
                    ')' => {
                        depth -= 1;
                        false
                    }
                    c => c.is_whitespace(),
                })
                .map_or(after.len(), |(i, _)| i);
            out.push((line.number, after[..end].to_owned()));
            rest = &after[end..];
        }
    }
    out
}

/// The anchor GitHub and mdBook give a heading: its text without Markdown, lower-cased, with
/// everything but letters, digits, `_`, `-` and spaces removed, and spaces made `-`.
fn slug(heading: &str) -> String {
    // Links keep their text only.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](") {
            Some(mid) => {
                let close = rest[open + mid..]
                    .find(')')
                    .map_or(rest.len(), |c| open + mid + c);
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = &rest[(close + 1).min(rest.len())..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| match c {
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c.to_lowercase().next()?),
            ' ' => Some('-'),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text's headings, duplicates numbered as GitHub and mdBook do.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in lines(text).into_iter().filter(|l| !l.code) {
        let hashes = line.text.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line.text[hashes..].starts_with(' ') {
            continue;
        }
        let title = line.text[hashes..].trim().trim_end_matches('#').trim();
        let base = slug(title);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// `path` with `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The broken links of one Markdown file, as messages.
fn broken_links(file: &Path) -> Vec<String> {
    let text = read(file);
    let dir = file.parent().unwrap();
    let guide = repo().join("docs/src");
    let mut broken = Vec::new();
    for (line, dest) in links(&text) {
        let at = format!("{}:{line}: `{dest}`", rel(file));
        if dest.is_empty() {
            broken.push(format!("{at}: an empty link"));
            continue;
        }
        if dest.contains("://") || dest.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match dest.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (dest.as_str(), None),
        };
        let target = if path.is_empty() {
            file.to_path_buf()
        } else {
            normalize(&dir.join(path))
        };
        if !target.exists() {
            broken.push(format!("{at}: {} does not exist", rel(&target)));
            continue;
        }
        if !target.starts_with(repo()) {
            broken.push(format!("{at}: it leaves the repository"));
            continue;
        }
        // mdBook renders docs/src only: a chapter's link must stay there.
        if file.starts_with(&guide) && !target.starts_with(&guide) {
            broken.push(format!(
                "{at}: the guide links outside docs/src, which the rendered book does not have \
                 (name the file as code instead)"
            ));
            continue;
        }
        if let Some(anchor) = anchor {
            if target.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&target)).contains(anchor)
            {
                broken.push(format!(
                    "{at}: {} has no heading whose anchor is `{anchor}`",
                    rel(&target)
                ));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let broken: Vec<String> = markdown_files()
        .iter()
        .flat_map(|f| broken_links(f))
        .collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_chapter_is_in_the_summary_and_doctested() {
    let summary = read(&repo().join("docs/src/SUMMARY.md"));
    let listed: BTreeSet<String> = links(&summary).into_iter().map(|(_, d)| d).collect();
    let lib = read(&repo().join("src/lib.rs"));
    let mut missing = Vec::new();
    for chapter in chapters() {
        let name = rel(&chapter)["docs/src/".len()..].to_owned();
        if !listed.contains(&name) {
            missing.push(format!("{name} is not in docs/src/SUMMARY.md"));
        }
        if !lib.contains(&format!("=> \"{name}\",")) {
            missing.push(format!(
                "{name} is not in src/lib.rs's `guide` module: its Rust blocks would not be tested"
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// Rust blocks are doctests: plain `rust`, or `rust,no_run` for a `build.rs` (it needs cargo's
/// build-script environment). A fence with no language would be compiled as Rust by rustdoc
/// and shown as plain text by GitHub, so every fence names one.
#[test]
fn every_code_block_names_its_language_and_rust_blocks_run() {
    let mut wrong = Vec::new();
    let mut files = chapters();
    files.push(repo().join("README.md"));
    for file in files {
        for (line, info) in fences(&read(&file)) {
            let at = format!("{}:{line}", rel(&file));
            if info.is_empty() {
                wrong.push(format!("{at}: a code block without a language"));
            } else if info.starts_with("rust") && info != "rust" && info != "rust,no_run" {
                wrong.push(format!(
                    "{at}: `{info}`: Rust blocks are `rust` (compiled and run) or `rust,no_run`"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_readme_stays_short() {
    let lines = read(&repo().join("README.md")).lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; keep it to 250 and move the rest into the guide (docs/src)"
    );
}

/// The rows of every Markdown table in the documents and in the crates' doc comments, with
/// where each is, whitespace collapsed. Separator rows (`|---|`) are left out.
fn table_rows() -> Vec<(String, String)> {
    let mut sources: Vec<(PathBuf, String)> = markdown_files()
        .into_iter()
        .filter(|f| !f.ends_with("CHANGELOG.md"))
        .map(|f| {
            let text = read(&f);
            (f, text)
        })
        .collect();
    for dir in ["src", "macros/src", "runtime/src", "build/src"] {
        for file in files_under(&repo().join(dir), ".rs") {
            let docs: Vec<String> = read(&file)
                .lines()
                .map(|l| {
                    let t = l.trim_start();
                    let doc = t.strip_prefix("///").or_else(|| t.strip_prefix("//!"));
                    doc.map(|d| d.strip_prefix(' ').unwrap_or(d).to_owned())
                        .unwrap_or_default()
                })
                .collect();
            sources.push((file, docs.join("\n")));
        }
    }
    let mut rows = Vec::new();
    for (file, text) in sources {
        for line in lines(&text).into_iter().filter(|l| !l.code) {
            let t = line.text.trim();
            let separator = t.chars().all(|c| "|-: ".contains(c));
            if t.len() > 2 && t.starts_with('|') && t.ends_with('|') && !separator {
                let row = t.split_whitespace().collect::<Vec<_>>().join(" ");
                rows.push((row, format!("{}:{}", rel(&file), line.number)));
            }
        }
    }
    rows
}

/// The options of `#[py_op]`: a row of the options table starts with one of them as its first
/// cell, alone in a code span (`` `tout = ...` ``, `` `numpy` ``).
const OPTIONS: [&str; 14] = [
    "file =",
    "code =",
    "module =",
    "package =",
    "name =",
    "numpy",
    "dlpack",
    "tout =",
    "grad =",
    "timeout_ms =",
    "workers =",
    "pool =",
    "batch(",
    "crate =",
];

/// The option a table row is about, if its first cell is one code span naming an option.
fn option_of(row: &str) -> Option<&'static str> {
    let cell = row.trim_start_matches('|').split('|').next()?.trim();
    let code = cell.strip_prefix('`')?.strip_suffix('`')?;
    if code.contains('`') {
        return None;
    }
    OPTIONS.into_iter().find(|o| {
        code == *o
            || (o.ends_with('=') && code.starts_with(&format!("{o} ")))
            || (o.ends_with('(') && code.starts_with(o))
    })
}

/// The options table lives in docs/src/reference/options.md, which the macro's documentation
/// includes: a row about an option anywhere else is the table written twice.
#[test]
fn the_options_table_is_written_once() {
    let home = "docs/src/reference/options.md";
    let mut elsewhere = Vec::new();
    let mut at_home = BTreeSet::new();
    for (row, at) in table_rows() {
        if let Some(option) = option_of(&row) {
            if at.starts_with(&format!("{home}:")) {
                at_home.insert(option);
            } else {
                elsewhere.push(format!("{at}: {row}"));
            }
        }
    }
    assert!(
        elsewhere.is_empty(),
        "the #[py_op] options table is written once, in {home}; these rows repeat it:\n{}",
        elsewhere.join("\n")
    );
    let missing: Vec<&str> = OPTIONS
        .into_iter()
        .filter(|o| !at_home.contains(o))
        .collect();
    assert!(missing.is_empty(), "{home} has no row for {missing:?}");
    let macros = read(&repo().join("macros/src/lib.rs"));
    assert!(
        macros.contains("include_str!(\"../../docs/src/reference/options.md\")"),
        "the macro's documentation includes {home}"
    );
}

/// A table row (of some length: short ones such as `| target | measured | |` recur as headers)
/// that appears twice is a table written twice; write it once and link to it.
#[test]
fn no_table_row_is_written_twice() {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (row, at) in table_rows() {
        if row.len() >= 40 {
            seen.entry(row).or_default().push(at);
        }
    }
    let twice: Vec<String> = seen
        .into_iter()
        .filter(|(_, at)| at.len() > 1)
        .map(|(row, at)| format!("{} : {row}", at.join(", ")))
        .collect();
    assert!(
        twice.is_empty(),
        "table rows written twice:\n{}",
        twice.join("\n")
    );
}

/// The guide's "Getting started" shows the README's set-up blocks, which CI builds and runs:
/// the copies must not drift.
#[test]
fn the_guide_shows_the_readme_set_up_blocks() {
    let readme = common::user_crate_blocks(&read(&repo().join("README.md")));
    let guide = common::user_crate_blocks(&read(&repo().join("docs/src/getting-started.md")));
    assert!(readme.contains_key("setup") && readme.contains_key("src/main.rs"));
    let names: BTreeSet<&String> = readme.keys().chain(guide.keys()).collect();
    let differ: Vec<&String> = names
        .into_iter()
        .filter(|n| readme.get(*n) != guide.get(*n))
        .collect();
    assert!(
        differ.is_empty(),
        "the blocks marked `<!-- user-crate: NAME -->` differ between README.md and \
         docs/src/getting-started.md (or one lacks them): {differ:?}"
    );
}

/// Step 4 makes the venv with the interpreter the build uses: `PYO3_PYTHON` from the shell,
/// else the one pinned in `.cargo/config.toml`, else `python3`. Run with stand-ins for the
/// interpreters, which write down how they were called.
#[cfg(unix)]
#[test]
fn step_4_uses_the_interpreter_the_build_uses() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    let setup = &common::user_crate_blocks(&read(&repo().join("README.md")))["setup"];
    let config = &common::user_crate_blocks(&read(&repo().join("README.md")))[".cargo/config.toml"];
    let work = std::env::temp_dir().join(format!("pyop-docs-step4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let fake = |path: &Path, name: &str| {
        let script = format!(
            "#!/bin/sh\necho \"{name} $*\" >> \"$LOG\"\nmkdir -p .venv/bin\n\
             printf '#!/bin/sh\\necho \"venv $*\" >> \"$LOG\"\\n' > .venv/bin/python\n\
             chmod +x .venv/bin/python\n"
        );
        std::fs::write(path, script).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    let bin = work.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    fake(&bin.join("python3"), "python3");
    fake(&work.join("pinned"), "pinned");
    fake(&work.join("shell"), "shell");
    let path = format!("{}:/usr/bin:/bin", bin.display());
    for (case, pinned, shell, expected) in [
        ("no pin", false, false, "python3"),
        ("pinned in .cargo/config.toml", true, false, "pinned"),
        ("pinned, and set in the shell", true, true, "shell"),
    ] {
        let app = work.join(case.replace(' ', "-"));
        std::fs::create_dir_all(&app).unwrap();
        if pinned {
            // The README's own block, naming the stand-in.
            std::fs::create_dir_all(app.join(".cargo")).unwrap();
            let pin = config.replace(
                "/opt/python3.12/bin/python3",
                &work.join("pinned").display().to_string(),
            );
            assert_ne!(&pin, config, "the README's example interpreter");
            std::fs::write(app.join(".cargo/config.toml"), pin).unwrap();
        }
        let log = app.join("log");
        let mut cmd = Command::new("sh");
        cmd.args(["-e", "-c", setup])
            .current_dir(&app)
            .env_clear()
            .env("PATH", &path)
            .env("LOG", &log);
        if shell {
            cmd.env("PYO3_PYTHON", work.join("shell"));
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{case}: step 4 failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            read(&log),
            format!("{expected} -m venv .venv\nvenv -m pip install numpy\n"),
            "{case}"
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// The slug rules on the headings this guide has.
#[test]
fn anchors_follow_github_and_mdbook() {
    assert_eq!(slug("The edit–run loop"), "the-editrun-loop");
    assert_eq!(slug("2. `Cargo.toml`"), "2-cargotoml");
    assert_eq!(slug("Outputs and `out`"), "outputs-and-out");
    assert_eq!(slug("`#[py_op]` options"), "py_op-options");
    assert_eq!(slug("pyop — candle ops"), "pyop--candle-ops");
    assert_eq!(slug("See [the guide](x.md)"), "see-the-guide");
    let text = "# A\n\n```sh\n# not a heading\n```\n\n## A\n";
    assert_eq!(
        anchors(text),
        BTreeSet::from(["a".to_owned(), "a-1".to_owned()])
    );
}
