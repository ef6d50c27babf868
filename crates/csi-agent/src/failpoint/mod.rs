//! Named failpoints: points in engine code where a test can inject a crash, an error or a
//! delay ("before and after every durable write and every RPC").
//!
//! This module owns the mechanism only: the registry of armed points, the
//! `CSI_AGENT_FAILPOINTS` syntax, and the hit counters. Each module names its own points
//! (`store.write.before_rename`, `volume.node_stage.before_rpc`, ...) and calls [`hit`]. This
//! module must not know any point's name, and it must cost nothing measurable when nothing is
//! armed: [`hit`] is then one relaxed atomic load.
//!
//! # Actions
//! - `exit`: the process dies at once, like `kill -9`: it sends itself `SIGKILL` (falling back
//!   to [`std::process::abort`]), so no destructor runs, no buffer is flushed and no file is
//!   closed cleanly. A parent sees the child killed by signal 9.
//! - `error`: [`hit`] returns [`FailpointError`], which the caller propagates as a failure.
//! - `sleep(MS)`: the calling thread sleeps `MS` milliseconds (a blocking sleep: on an async
//!   runtime it stalls that worker, which is what a slow disk or a slow syscall does too).
//! - `off`: disarms the point (useful to override an earlier entry).
//!
//! An action may be prefixed by `N*`: it then fires on the N-th hit only (counted from the
//! moment it was armed) and the point is inert before and after. Without a count it fires on
//! every hit.
//!
//! # Arming
//! - Programmatically: [`arm`], [`arm_nth`], [`disarm`], [`disarm_all`].
//! - For one thread only: [`arm_local`] returns a guard; the point fires only on the calling
//!   thread until the guard is dropped. Tests in one binary run in parallel threads, so a test
//!   that breaks `store.write.before_rename` for everyone would break its neighbours; a local
//!   arm does not (it suits synchronous code and current-thread async runtimes).
//! - From the environment: `CSI_AGENT_FAILPOINTS="name=action;name=N*action;..."`, e.g.
//!   `store.write.after_rename=exit;volume.node_stage.before_rpc=2*error;x=sleep(50)`. It is
//!   read once, at the first [`hit`] of the process, or earlier by [`init_from_env`], which
//!   reports a malformed spec (the daemon should call it at start-up and refuse to run on
//!   error). A malformed spec found lazily by [`hit`] is logged and ignored, since [`hit`]
//!   cannot fail the caller for it.
//!
//! # Counting
//! While anything is armed (or [`count_hits`] is on), every [`hit`] is counted per name and
//! [`hits`] reads the count. Nothing is counted on the unarmed fast path.
//!
//! # Compiled in only for tests
//! The registry exists only with the `failpoints` cargo feature ([`armed`]). The crash tests
//! get it through the dev-dependencies (`cargo test` builds the daemon with it); a plain
//! `cargo build` (the demo, `--release`) does not, and then [`hit`] is an inlined `Ok(())`:
//! the hot path carries no lookup, no point's name is left in the binary, and
//! [`init_from_env`] only warns that `CSI_AGENT_FAILPOINTS` is ignored. `.ci/run` checks a
//! release build for failpoint symbols (`scripts/check-release`).

#[cfg(feature = "failpoints")]
mod armed;
#[cfg(feature = "failpoints")]
pub use armed::{
    Action, LocalGuard, Trigger, arm, arm_from_spec, arm_local, arm_local_nth, arm_nth, count_hits,
    disarm, disarm_all, hit, hits, init_from_env, parse_spec,
};

/// The environment variable read by [`init_from_env`] and by the first [`hit`].
pub const ENV_VAR: &str = "CSI_AGENT_FAILPOINTS";

/// The error an `error` failpoint injects.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("failpoint {name} injected an error")]
pub struct FailpointError {
    pub name: String,
}

/// A malformed failpoint spec; names the offending entry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad failpoint spec entry `{entry}`: {reason}")]
pub struct SpecError {
    pub entry: String,
    pub reason: String,
}

/// Marks a named point: without the `failpoints` feature, nothing at all.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) -> Result<(), FailpointError> {
    Ok(())
}

/// Without the `failpoints` feature there is nothing to arm: a set `CSI_AGENT_FAILPOINTS` is
/// reported and ignored, so a stray variable cannot change what a production daemon does.
#[cfg(not(feature = "failpoints"))]
pub fn init_from_env() -> Result<(), SpecError> {
    if std::env::var_os(ENV_VAR).is_some() {
        tracing::warn!(
            "{ENV_VAR} is set but this build has no failpoints (cargo feature `failpoints`): ignored"
        );
    }
    Ok(())
}
