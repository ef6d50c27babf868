//! Finding the workspace's other binaries (the test plugin, the daemon, the CLI) beside the
//! running executable, whatever `CARGO_TARGET_DIR` and profile it was built with.
//!
//! Tests and tools need `csi-testplugin` and friends; a hard-coded `target/debug` breaks as
//! soon as `CARGO_TARGET_DIR` is set. The running executable already sits in the right
//! directory (`<target>/<profile>/`, or `<target>/<profile>/deps/` for a test binary), so look
//! there. It must not build anything.

use std::path::PathBuf;

/// `<dir of the running executable>/<name>`, or one level up from a `deps/` dir. `None` when
/// no such file exists there.
pub fn beside_current_exe(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?.to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    path.exists().then_some(path)
}

/// Like [`beside_current_exe`], for tests: panics with what to build when the binary is
/// missing. `override_var` names an environment variable that, when set, wins.
pub fn required(name: &str, override_var: Option<&str>) -> PathBuf {
    if let Some(path) = override_var.and_then(std::env::var_os) {
        return PathBuf::from(path);
    }
    match beside_current_exe(name) {
        Some(path) => path,
        None => panic!(
            "{name} is missing beside {}: build the workspace first (cargo build --workspace)",
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ),
    }
}
