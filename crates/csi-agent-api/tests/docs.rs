//! Keeps the operators' documents in step with the code, so that they cannot drift:
//! - `docs/api.md`'s route table is `routes::ALL_ROUTES` (the daemon's router is built from that
//!   list, and `tests/openapi.rs` holds `openapi.yaml` to it);
//! - `docs/recovery.md`'s failpoint table names exactly the points the engine hits, and every
//!   count of failpoints in the docs' prose is the table's.
//!
//! These tests read sources and documents as text: they link nothing of the engine and need no
//! root, so they run in a second. Each failure says what to add or remove, and where.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use csi_agent_api::routes::ALL_ROUTES;

#[test]
fn api_md_route_table_is_all_routes() -> Result<()> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.md");
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    // Rows of the route table: "| GET | `/v1/health` | … |".
    let documented: BTreeSet<(String, String)> = text
        .lines()
        .filter_map(|line| {
            let mut cells = line.split('|').map(str::trim).skip(1);
            let method = cells.next()?;
            let path = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
            ["GET", "POST", "DELETE", "PUT", "PATCH"]
                .contains(&method)
                .then(|| (method.to_owned(), path.to_owned()))
        })
        .collect();
    let expected: BTreeSet<(String, String)> = ALL_ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    ensure!(
        documented == expected,
        "docs/api.md's route table differs from routes::ALL_ROUTES: rows naming no route \
         (remove them or fix them): {:?}; routes without a row (add \
         `| METHOD | `path` | what | csictl command |` for each): {:?}",
        documented.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&documented).collect::<Vec<_>>()
    );
    // And each has its section, with its body and answer.
    let headings: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("#### `"))
        .collect();
    let undescribed: Vec<String> = ALL_ROUTES
        .iter()
        .map(|(method, path)| format!("{method} {path}"))
        .filter(|route| !headings.iter().any(|h| h.starts_with(&format!("{route}`"))))
        .collect();
    ensure!(
        undescribed.is_empty(),
        "routes without a \"#### `METHOD /path`\" section in docs/api.md: {undescribed:?}; \
         add one for each, with its request and answer"
    );
    Ok(())
}

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The points of the table of docs/recovery.md's `## Failpoints` section, in table order.
fn failpoint_table() -> Result<Vec<String>> {
    let doc = read(&repo().join("docs/recovery.md"))?;
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Failpoints\n"))
        .context("docs/recovery.md has no `## Failpoints` section")?;
    let mut points: Vec<String> = Vec::new();
    for row in section.lines().filter_map(|l| l.strip_prefix("| `")) {
        let name = row.split('`').next().unwrap_or_default().to_owned();
        ensure!(
            !points.contains(&name),
            "docs/recovery.md lists failpoint {name} twice: keep one row"
        );
        points.push(name);
    }
    ensure!(
        points.len() > 10,
        "the failpoint table of docs/recovery.md did not parse: {points:?}"
    );
    Ok(points)
}

/// The engine's sources, comment lines left out (they may quote calls), with their paths.
fn engine_sources() -> Result<Vec<(PathBuf, String)>> {
    let mut dirs = vec![repo().join("crates/csi-agent/src")];
    let mut sources = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("{}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let code = read(&path)?
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .fold(String::new(), |code, l| code + l + "\n");
                sources.push((path, code));
            }
        }
    }
    Ok(sources)
}

/// The text between `start` (just after an opening delimiter) and the first `end` after it.
fn until(text: &str, end: char) -> Option<&str> {
    text.find(end).map(|i| &text[..i])
}

/// The names a `failpoint::hit(arg)` may hit, resolved in the sources: a string literal; a
/// `const NAME: &str = "…"`; or a field (`points.before_rpc`) set by a macro to
/// `concat!("volume.", $step, ".before_rpc")`, one name per `points!("step")` call. Any other
/// argument is an error, so that a new way of naming points cannot slip past the check.
fn resolve_hit(arg: &str, sources: &[(PathBuf, String)]) -> Result<Vec<String>> {
    if let Some(literal) = arg.strip_prefix('"') {
        let name = literal
            .strip_suffix('"')
            .context("an unterminated literal")?;
        return Ok(vec![name.to_owned()]);
    }
    if let Some((_, field)) = arg.rsplit_once('.') {
        let setter = format!("{field}: concat!(");
        let (code, at) = sources
            .iter()
            .find_map(|(_, code)| code.find(&setter).map(|at| (code, at + setter.len())))
            .with_context(|| format!("no `{setter}…)` sets it"))?;
        let parts: Vec<&str> = until(&code[at..], ')')
            .context("an unterminated concat!")?
            .split(',')
            .map(str::trim)
            .collect();
        let [prefix, step, suffix] = parts[..] else {
            bail!("`{setter}` is not `concat!(\"prefix\", $step, \"suffix\")`");
        };
        ensure!(
            step.starts_with('$'),
            "`{setter}`'s middle part is no $metavariable"
        );
        let (prefix, suffix) = (prefix.trim_matches('"'), suffix.trim_matches('"'));
        let macro_at = code[..at]
            .rfind("macro_rules! ")
            .context("not in a macro_rules!")?;
        let macro_name = until(&code[macro_at + "macro_rules! ".len()..], ' ')
            .context("a macro_rules! without a name")?;
        let call = format!("{macro_name}!(\"");
        let names: Vec<String> = code
            .match_indices(&call)
            .filter_map(|(i, _)| until(&code[i + call.len()..], '"'))
            .map(|step| format!("{prefix}{step}{suffix}"))
            .collect();
        ensure!(!names.is_empty(), "no `{call}…)` expands the macro");
        return Ok(names);
    }
    let ident = arg.rsplit("::").next().unwrap_or(arg);
    let definition = format!("const {ident}: &str = \"");
    sources
        .iter()
        .find_map(|(_, code)| {
            let at = code.find(&definition)? + definition.len();
            until(&code[at..], '"').map(|name| vec![name.to_owned()])
        })
        .with_context(|| format!("no `{definition}…\";` defines it"))
}

/// Every failpoint name hit by the engine (crates/csi-agent/src).
fn failpoints_in_engine() -> Result<BTreeSet<String>> {
    let sources = engine_sources()?;
    let mut names = BTreeSet::new();
    for (path, code) in &sources {
        for (at, _) in code.match_indices("failpoint::hit(") {
            let arg = until(&code[at + "failpoint::hit(".len()..], ')')
                .unwrap_or_default()
                .trim();
            let resolved = resolve_hit(arg, &sources).with_context(|| {
                format!(
                    "{}: cannot resolve the failpoint of `failpoint::hit({arg})`; name it with \
                     a string literal or a `const NAME: &str`",
                    path.display()
                )
            })?;
            names.extend(resolved);
        }
    }
    ensure!(
        names.len() > 10,
        "no failpoint found in the sources: {names:?}"
    );
    Ok(names)
}

#[test]
fn the_failpoint_table_names_exactly_the_engines_failpoints() -> Result<()> {
    let table: BTreeSet<String> = failpoint_table()?.into_iter().collect();
    let engine = failpoints_in_engine()?;
    let undocumented: Vec<_> = engine.difference(&table).collect();
    let stale: Vec<_> = table.difference(&engine).collect();
    ensure!(
        undocumented.is_empty(),
        "failpoints hit in crates/csi-agent/src without a row in docs/recovery.md's table \
         (`## Failpoints`): {undocumented:?}; add `| `name` | where it is |` for each"
    );
    ensure!(
        stale.is_empty(),
        "rows of docs/recovery.md's failpoint table that no `failpoint::hit` in \
         crates/csi-agent/src names: {stale:?}; remove them or fix the name"
    );
    Ok(())
}

/// Every "N points" or "N failpoints" in the docs' prose is the number of rows of the table,
/// so that adding a point without updating the prose fails here.
#[test]
fn every_failpoint_count_in_the_docs_is_the_tables() -> Result<()> {
    let rows = failpoint_table()?.len();
    let mut files = vec![repo().join("README.md")];
    for entry in std::fs::read_dir(repo().join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut counts = 0;
    for path in files {
        let text = read(&path)?;
        let words: Vec<&str> = text.split_whitespace().collect();
        for (i, pair) in words.windows(2).enumerate() {
            let noun = pair[1].trim_end_matches(|c: char| !c.is_alphanumeric());
            let Ok(count) = pair[0].parse::<usize>() else {
                continue;
            };
            if noun != "points" && noun != "failpoints" {
                continue;
            }
            counts += 1;
            let context = words[i.saturating_sub(4)..(i + 6).min(words.len())].join(" ");
            ensure!(
                count == rows,
                "{}: \"{context}\": says {count} failpoints, the table of docs/recovery.md has \
                 {rows} rows; write {rows}",
                path.display()
            );
        }
    }
    ensure!(counts > 0, "no failpoint count found in the docs' prose");
    Ok(())
}
