//! The one boundary for blocking system calls made on the async path of an operation: mount,
//! umount, `statx`, directory creation and removal, mount-table reads. They run through
//! [`blocking`], which tells the async runtime that this worker is about to block
//! (`tokio::task::block_in_place`), so that the worker's other tasks (status reads, other
//! volumes, other plugins) move to another worker instead of waiting behind a slow disk or a
//! hung NFS mount; and it logs a call that took unusually long.
//!
//! Why no hard timeout: a mount or umount stuck in the kernel cannot be cancelled, and an
//! operation that gave up on one while it still runs would let the reconciler retry against a
//! mount that is half there. The volume's lock stays held instead (only that volume waits), its
//! `operation` shows where it is, and the warning names the call.
//!
//! Creating, probing and removing a staging or target directory does not need it:
//! `crate::volume::mount_dirs` does those from the parent without entering a mount on the
//! path, inline.
//!
//! It must not be used for long-running work (a layer download, a whole recovery): that
//! belongs in `spawn_blocking` or its own task. fsyncs of the store go through the store's own
//! writer thread.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A call slower than this is logged at warn.
pub const SLOW_CALL: Duration = Duration::from_secs(2);

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `work`, a short blocking system call (or a few), without stalling the async worker's
/// other tasks. `what` names it in the slow-call warning.
pub fn blocking<T>(what: &'static str, work: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let on_worker = !INSIDE.with(Cell::get)
        && tokio::runtime::Handle::try_current().is_ok_and(|handle| {
            handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
    let value = if on_worker {
        tokio::task::block_in_place(|| {
            INSIDE.with(|inside| inside.set(true));
            let value = work();
            INSIDE.with(|inside| inside.set(false));
            value
        })
    } else {
        // A current-thread runtime (tests, tools) or already inside: nothing to hand over.
        work()
    };
    let took = started.elapsed();
    if took >= SLOW_CALL {
        tracing::warn!(
            call = what,
            took_ms = took.as_millis() as u64,
            "slow system call"
        );
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_inline_without_a_runtime() {
        assert_eq!(blocking("test", || 7), 7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn runs_inline_on_a_current_thread_runtime() {
        assert_eq!(blocking("test", || 8), 8);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_blocked_worker_hands_its_other_tasks_over() {
        // One worker, running both tasks: without the hand-over the ticker could not run while
        // the call blocks that worker.
        let started = Instant::now();
        let blocked = tokio::spawn(async {
            blocking("outer", || {
                std::thread::sleep(Duration::from_millis(400));
                blocking("inner", || 9)
            })
        });
        let ticker = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Instant::now()
        });
        let ticked = ticker.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(blocked.await.unwrap_or_else(|e| panic!("{e}")), 9);
        assert!(
            ticked.duration_since(started) < Duration::from_millis(300),
            "the other task waited {:?} for the blocking call",
            ticked.duration_since(started)
        );
    }
}
