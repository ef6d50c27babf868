//! Keeps the operators' API document (`docs/api.md`) in step with `routes::ALL_ROUTES`: every
//! route appears in its route table, and the table lists no route that does not exist.

use std::collections::BTreeSet;

use anyhow::{Context, Result, ensure};
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
        "only in docs/api.md: {:?}; only in routes::ALL_ROUTES: {:?}",
        documented.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&documented).collect::<Vec<_>>()
    );
    Ok(())
}
