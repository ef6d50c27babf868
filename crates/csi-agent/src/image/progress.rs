//! The pulls in flight and how far each has come: per blob, the bytes stored out of the
//! manifest's size, for `GET /v1/images/pulls`, a plugin waiting for its image and the progress
//! bar of `csictl image pull` (issue #13, item 2).
//!
//! It owns that bookkeeping only: [`super::pull`] reports into it as blobs stream, and readers
//! take [`PullProgress::snapshot`]s. It must not decide anything about a pull (limits,
//! retries) nor hold a lock while bytes are counted: a blob's count is an atomic, so a reader
//! never slows a download.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// Every pull in flight, by reference.
#[derive(Debug, Default)]
pub struct PullProgress {
    pulls: Mutex<BTreeMap<String, Arc<Pull>>>,
}

#[derive(Debug)]
struct Pull {
    started_at_unix_ms: u64,
    blobs: Mutex<Vec<Arc<BlobProgress>>>,
}

/// One blob of a pull: its manifest size and the bytes stored so far.
#[derive(Debug)]
pub struct BlobProgress {
    digest: String,
    total: u64,
    done: AtomicU64,
}

impl BlobProgress {
    /// `bytes` more received.
    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The blob was in the store already, or is complete.
    pub fn complete(&self) {
        self.done.store(self.total, Ordering::Relaxed);
    }
}

/// A pull, as seen at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullSnapshot {
    pub reference: String,
    pub started_at_unix_ms: u64,
    /// Config and layers, in the order the manifest lists them.
    pub blobs: Vec<BlobSnapshot>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobSnapshot {
    pub digest: String,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

impl PullSnapshot {
    pub fn bytes_done(&self) -> u64 {
        self.blobs.iter().map(|b| b.bytes_done).sum()
    }

    pub fn bytes_total(&self) -> u64 {
        self.blobs.iter().map(|b| b.bytes_total).sum()
    }
}

/// A pull's registration; the pull leaves the table when this is dropped (done, failed or
/// abandoned alike).
#[derive(Debug)]
pub struct PullGuard {
    table: Arc<PullProgress>,
    reference: String,
    pull: Arc<Pull>,
}

impl PullProgress {
    /// Registers a pull of `reference`. A second pull of the same reference (a retry racing
    /// the end of the first) replaces the first's entry; the first's guard then leaves the
    /// second's alone.
    pub fn begin(self: &Arc<Self>, reference: &str) -> PullGuard {
        let pull = Arc::new(Pull {
            started_at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            blobs: Mutex::new(Vec::new()),
        });
        self.lock().insert(reference.to_owned(), Arc::clone(&pull));
        PullGuard {
            table: Arc::clone(self),
            reference: reference.to_owned(),
            pull,
        }
    }

    /// The pulls in flight, by reference.
    pub fn snapshot(&self) -> Vec<PullSnapshot> {
        self.lock()
            .iter()
            .map(|(reference, pull)| PullSnapshot {
                reference: reference.clone(),
                started_at_unix_ms: pull.started_at_unix_ms,
                blobs: pull
                    .blobs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .iter()
                    .map(|blob| BlobSnapshot {
                        digest: blob.digest.clone(),
                        // A registry sending more than the manifest said is refused by the
                        // store; until then the count must not claim more than 100 %.
                        bytes_done: blob.done.load(Ordering::Relaxed).min(blob.total),
                        bytes_total: blob.total,
                    })
                    .collect(),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Pull>>> {
        // A poisoned lock only means a panicking holder; the map is still valid.
        self.pulls.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl PullGuard {
    /// Registers a blob of the pull (once its size is known from the manifest).
    pub fn blob(&self, digest: &str, total: u64) -> Arc<BlobProgress> {
        let blob = Arc::new(BlobProgress {
            digest: digest.to_owned(),
            total,
            done: AtomicU64::new(0),
        });
        self.pull
            .blobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&blob));
        blob
    }
}

impl Drop for PullGuard {
    fn drop(&mut self) {
        let mut pulls = self.table.lock();
        if pulls
            .get(&self.reference)
            .is_some_and(|current| Arc::ptr_eq(current, &self.pull))
        {
            pulls.remove(&self.reference);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_is_listed_with_its_bytes_until_its_guard_goes() {
        let table = Arc::new(PullProgress::default());
        let guard = table.begin("r/a:1");
        let config = guard.blob("sha256:c", 10);
        let layer = guard.blob("sha256:l", 1000);
        config.complete();
        layer.add(250);
        layer.add(250);
        let pulls = table.snapshot();
        assert_eq!(pulls.len(), 1);
        assert_eq!(pulls[0].reference, "r/a:1");
        assert_eq!((pulls[0].bytes_done(), pulls[0].bytes_total()), (510, 1010));
        assert_eq!(pulls[0].blobs[1].digest, "sha256:l");
        // More than the manifest said is shown as complete, not beyond.
        layer.add(5000);
        assert_eq!(table.snapshot()[0].blobs[1].bytes_done, 1000);
        drop(guard);
        assert!(table.snapshot().is_empty());
    }

    #[test]
    fn an_old_guard_does_not_remove_a_newer_pull_of_the_same_reference() {
        let table = Arc::new(PullProgress::default());
        let first = table.begin("r/a:1");
        let second = table.begin("r/a:1");
        drop(first);
        assert_eq!(table.snapshot().len(), 1);
        drop(second);
        assert!(table.snapshot().is_empty());
    }
}
