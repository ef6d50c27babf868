//! README.md's two commands are the ones CI runs: a newcomer types exactly what is tested.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

fn repo_file(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(name),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The first `sh` code blocks of the README, one command each.
fn first_commands(readme: &str, count: usize) -> Vec<String> {
    readme
        .split("```sh\n")
        .skip(1)
        .take(count)
        .map(|block| block.split("```").next().unwrap_or("").trim().to_owned())
        .collect()
}

#[test]
fn the_readme_starts_with_the_demo_and_the_test_command_and_ci_runs_both() {
    let readme = repo_file("README.md");
    let two = readme
        .find("## Two commands")
        .expect("a 'Two commands' section");
    assert!(
        readme[..two].matches("```").count() == 0,
        "the two commands come before any other code block"
    );
    assert_eq!(
        first_commands(&readme, 2),
        vec!["./scripts/demo".to_owned(), "./scripts/test".to_owned()]
    );
    let ci = repo_file(".ci/run");
    // `timed` (a function of .ci/run) only reports how long the step took.
    let lines: Vec<&str> = ci
        .lines()
        .map(|line| line.trim().trim_start_matches("timed "))
        .collect();
    // As a newcomer types them: a non-root user with sudo, in their own clone (issue #30).
    assert!(
        lines.contains(&".ci/as-newcomer ./scripts/test"),
        ".ci/run runs ./scripts/test as written, as a newcomer"
    );
    assert!(lines.contains(&".ci/as-newcomer .ci/demo-check"));
    assert!(lines.contains(&".ci/as-newcomer .ci/demo-check --sudo"));
    let demo_check = repo_file(".ci/demo-check");
    assert!(
        demo_check.contains("demo_cmd=(./scripts/demo)")
            && demo_check.contains("demo_cmd=(sudo ./scripts/demo)"),
        ".ci/demo-check runs ./scripts/demo, and sudo ./scripts/demo with --sudo"
    );
    // README's container variations (issue #23), each run by CI as a newcomer types it.
    for variation in ["--oci", "--image"] {
        assert!(
            readme.contains(&format!("./scripts/demo {variation}")),
            "README shows ./scripts/demo {variation}"
        );
        assert!(
            lines.contains(&format!(".ci/as-newcomer .ci/demo-check {variation}").as_str()),
            ".ci/run runs .ci/demo-check {variation}"
        );
    }
    // README's "Try it", as a sudo user types it.
    for step in [
        "sudo ./target/debug/csictl plugins",
        "echo hello | sudo tee csi-agent-sandboxes/w1/data/hello",
    ] {
        assert!(readme.contains(step), "README's Try it has `{step}`");
    }
}
