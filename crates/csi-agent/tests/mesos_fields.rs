//! The Mesos compatibility table of docs/configuration.md covers every field of the vendored
//! list docs/mesos-fields.txt (Mesos's `mesos.proto`): a field without a row, a row for a
//! field that is not in the list (a typo), a field with two rows, or a verdict outside the
//! documented vocabulary fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const VERDICTS: [&str; 6] = [
    "honoured",
    "honoured differently",
    "isolation",
    "rejected",
    "warned",
    "ignored",
];

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The `Message.field` lines of the vendored list.
fn vendored_fields(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// `field -> [verdicts]` from the rows of the first table under `section` (a `## ` heading):
/// rows whose first cell is one back-quoted name.
fn table_rows(markdown: &str, section: &str) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let start = markdown
        .find(&format!("\n{section}\n"))
        .ok_or_else(|| anyhow::anyhow!("no section {section:?}"))?;
    let body = &markdown[start + section.len() + 2..];
    let body = body.find("\n## ").map_or(body, |end| &body[..end]);
    let mut rows: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in body.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let Some(name) = cells
            .first()
            .and_then(|c| c.strip_prefix('`'))
            .and_then(|c| c.strip_suffix('`'))
        else {
            continue;
        };
        rows.entry(name.to_owned())
            .or_default()
            .push(cells.get(1).copied().unwrap_or_default().to_owned());
    }
    Ok(rows)
}

#[test]
fn mesos_compatibility_table_covers_every_vendored_field() -> anyhow::Result<()> {
    let fields = vendored_fields(&std::fs::read_to_string(repo_file(
        "docs/mesos-fields.txt",
    ))?);
    // The list itself is what it says: the five messages of the issue and what they reach.
    for must in [
        "CSIPluginInfo.type",
        "CSIPluginContainerInfo.container",
        "CSIPluginEndpoint.endpoint",
        "CommandInfo.uris",
        "ContainerInfo.linux_info",
        "Volume.Source.HostPath.mount_propagation",
        "RLimitInfo.RLimit.soft",
        "Environment.Variable.secret",
        "CommandInfo.URI.output_file",
        "Resource.scalar",
    ] {
        assert!(fields.iter().any(|f| f == must), "{must} not vendored");
    }
    let rows = table_rows(
        &std::fs::read_to_string(repo_file("docs/configuration.md"))?,
        "## Compatibility with Mesos",
    )?;

    let missing: Vec<&String> = fields.iter().filter(|f| !rows.contains_key(*f)).collect();
    assert!(missing.is_empty(), "fields without a row: {missing:?}");
    let unknown: Vec<&String> = rows.keys().filter(|r| !fields.contains(r)).collect();
    assert!(
        unknown.is_empty(),
        "rows for fields not in docs/mesos-fields.txt: {unknown:?}"
    );
    for (field, verdicts) in &rows {
        assert_eq!(verdicts.len(), 1, "{field} has {} rows", verdicts.len());
        assert!(
            VERDICTS.contains(&verdicts[0].as_str()),
            "{field}: verdict {:?} is not one of {VERDICTS:?}",
            verdicts[0]
        );
    }
    Ok(())
}

#[test]
fn the_table_parser_sees_a_missing_row() -> anyhow::Result<()> {
    // The check above could pass by parsing nothing: a table with one row short is seen.
    let doc = "# x\n\n## Compatibility with Mesos\n\n| field | verdict | what |\n|---|---|---|\n\
               | `A.b` | honoured | x |\n| `A.c` | maybe | y |\n\n## Next\n\n| `A.d` | ignored | z |\n";
    let rows = table_rows(doc, "## Compatibility with Mesos")?;
    assert_eq!(rows.keys().collect::<Vec<_>>(), vec!["A.b", "A.c"]);
    assert_eq!(rows["A.c"], vec!["maybe".to_owned()]);
    assert!(!VERDICTS.contains(&"maybe"));
    let fields = vendored_fields("# comment\nA.b\n\nA.d\n");
    assert_eq!(fields, vec!["A.b", "A.d"]);
    assert!(
        !rows.contains_key("A.d"),
        "a row of the next section counted"
    );
    Ok(())
}
