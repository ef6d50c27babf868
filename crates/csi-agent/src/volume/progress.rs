//! What each volume's operation is doing right now, for status reads: which operation, which
//! step, the attempt, the last transient error and when the next retry is due. Also the
//! de-duplication of background reconcilers: at most one per volume, and a request that
//! arrives while one runs makes it go round once more instead of starting a second.
//!
//! This module owns only in-memory, advisory state: nothing here is durable, nothing here
//! decides what an operation does, and a read of it never waits for an operation (each access
//! is one short `std` mutex section). Entries exist only while an operation runs or a
//! reconciler retries, so requests naming unknown ids leave nothing behind.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

/// One volume's operation in progress, as a status read shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// `publish`, `unpublish` or `reconcile`.
    pub operation: &'static str,
    /// The lifecycle step being tried (`node_stage`, …), once one started.
    pub step: Option<&'static str>,
    /// Attempts of the current step (or, for a reconciler, of the whole drive) so far.
    pub attempt: u32,
    /// The last transient error, shown while retrying.
    pub last_error: Option<String>,
    /// When the next attempt is due, while waiting for it.
    pub next_retry_at: Option<SystemTime>,
}

#[derive(Debug, Default)]
pub struct Tracker {
    running: Mutex<HashMap<String, Progress>>,
    /// Volumes with a background reconciler.
    reconcilers: Mutex<HashMap<String, Reconciler>>,
}

#[derive(Debug, Default)]
struct Reconciler {
    /// Another request asked for a reconciler while this one ran: it drives once more.
    again: bool,
    /// Failed drives so far, the last error and when the next is due (while waiting).
    attempt: u32,
    last_error: Option<String>,
    next_retry_at: Option<SystemTime>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each section is a single insert, update or removal: a panic cannot leave it half done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Tracker {
    /// Marks `operation` as running on `volume_id` until the guard is dropped.
    pub fn begin<'a>(&'a self, volume_id: &str, operation: &'static str) -> Running<'a> {
        lock(&self.running).insert(
            volume_id.to_owned(),
            Progress {
                operation,
                step: None,
                attempt: 0,
                last_error: None,
                next_retry_at: None,
            },
        );
        Running {
            tracker: self,
            volume_id: volume_id.to_owned(),
        }
    }

    /// The operation in progress on `volume_id`, if any: a request's, else a background
    /// reconciler waiting to try again.
    pub fn get(&self, volume_id: &str) -> Option<Progress> {
        if let Some(progress) = lock(&self.running).get(volume_id) {
            return Some(progress.clone());
        }
        let reconcilers = lock(&self.reconcilers);
        let reconciler = reconcilers.get(volume_id)?;
        Some(Progress {
            operation: "reconcile",
            step: None,
            attempt: reconciler.attempt,
            last_error: reconciler.last_error.clone(),
            next_retry_at: reconciler.next_retry_at,
        })
    }

    /// Records a failed drive of a background reconciler, retried after `delay`.
    pub fn reconciler_failed(&self, volume_id: &str, error: &str, delay: Duration) -> u32 {
        let mut reconcilers = lock(&self.reconcilers);
        let Some(reconciler) = reconcilers.get_mut(volume_id) else {
            return 0;
        };
        reconciler.attempt = reconciler.attempt.saturating_add(1);
        reconciler.last_error = Some(error.to_owned());
        reconciler.next_retry_at = SystemTime::now().checked_add(delay);
        reconciler.attempt
    }

    /// Records an attempt of `step` that failed transiently and is retried after `delay`.
    pub fn retrying(
        &self,
        volume_id: &str,
        step: Option<&'static str>,
        attempt: u32,
        error: &str,
        delay: Duration,
    ) {
        if let Some(progress) = lock(&self.running).get_mut(volume_id) {
            progress.step = step.or(progress.step);
            progress.attempt = attempt;
            progress.last_error = Some(error.to_owned());
            progress.next_retry_at = SystemTime::now().checked_add(delay);
        }
    }

    /// Records that `step` is being tried (its first attempt, or the next one now due).
    pub fn trying(&self, volume_id: &str, step: &'static str, attempt: u32) {
        if let Some(progress) = lock(&self.running).get_mut(volume_id) {
            progress.step = Some(step);
            progress.attempt = attempt;
            progress.next_retry_at = None;
        }
    }

    /// Asks for a background reconciler of `volume_id`: true when the caller must start one,
    /// false when one runs already (it was told to drive once more).
    pub fn want_reconciler(&self, volume_id: &str) -> bool {
        let mut reconcilers = lock(&self.reconcilers);
        match reconcilers.get_mut(volume_id) {
            Some(reconciler) => {
                reconciler.again = true;
                false
            }
            None => {
                reconcilers.insert(volume_id.to_owned(), Reconciler::default());
                true
            }
        }
    }

    /// Called by a reconciler that converged: true when it must drive once more (asked while
    /// it ran), false when it ends (and is forgotten).
    pub fn reconciler_done(&self, volume_id: &str) -> bool {
        let mut reconcilers = lock(&self.reconcilers);
        match reconcilers.get_mut(volume_id) {
            Some(reconciler) if reconciler.again => {
                reconciler.again = false;
                reconciler.next_retry_at = None;
                true
            }
            _ => {
                reconcilers.remove(volume_id);
                false
            }
        }
    }

    /// Called by a reconciler that ends without converging (the node drains): forgotten.
    pub fn reconciler_stopped(&self, volume_id: &str) {
        lock(&self.reconcilers).remove(volume_id);
    }

    /// How many entries are held (bounded-state tests).
    pub fn len(&self) -> usize {
        lock(&self.running).len() + lock(&self.reconcilers).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Clears a volume's progress when its operation ends, however it ends.
#[derive(Debug)]
pub struct Running<'a> {
    tracker: &'a Tracker,
    volume_id: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        lock(&self.tracker.running).remove(&self.volume_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lives_as_long_as_its_operation() {
        let tracker = Tracker::default();
        {
            let _running = tracker.begin("v", "publish");
            tracker.trying("v", "node_stage", 1);
            tracker.retrying("v", None, 1, "UNAVAILABLE: busy", Duration::from_secs(2));
            let progress = tracker.get("v").unwrap_or_else(|| panic!("no progress"));
            assert_eq!(progress.operation, "publish");
            assert_eq!(progress.step, Some("node_stage"));
            assert_eq!(progress.last_error.as_deref(), Some("UNAVAILABLE: busy"));
            assert!(
                progress
                    .next_retry_at
                    .is_some_and(|at| at > SystemTime::now())
            );
        }
        assert_eq!(tracker.get("v"), None);
        assert!(tracker.is_empty());
        tracker.retrying("unknown", None, 1, "x", Duration::ZERO);
        assert!(
            tracker.is_empty(),
            "no entry for a volume without an operation"
        );
    }

    #[test]
    fn one_reconciler_per_volume_and_none_is_lost() {
        let tracker = Tracker::default();
        assert!(tracker.want_reconciler("v"));
        assert_eq!(
            tracker.reconciler_failed("v", "UNAVAILABLE", Duration::from_secs(1)),
            1
        );
        let waiting = tracker.get("v").unwrap_or_else(|| panic!("no progress"));
        assert_eq!((waiting.operation, waiting.attempt), ("reconcile", 1));
        assert!(!tracker.want_reconciler("v"), "a second is not started");
        assert!(tracker.reconciler_done("v"), "asked meanwhile: once more");
        assert!(!tracker.reconciler_done("v"), "then it ends");
        assert!(tracker.is_empty());
        assert!(
            tracker.want_reconciler("v"),
            "a later request starts a new one"
        );
    }
}
