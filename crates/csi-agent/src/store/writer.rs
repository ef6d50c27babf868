//! The writer thread of the records' database and the queue that feeds it: group commit,
//! lazy notes and the commit delay.
//!
//! Every write joins one ordered queue under a mutex; the writer takes everything queued at
//! once and commits it in one transaction. Senders wake the writer only when what it waits
//! for has changed — the first durable write (someone waits for a commit), the first note
//! (its flush deadline starts), a full batch, the close — so the progress notes that follow
//! every RPC cost a lock and a push, not a thread wake-up (docs/benchmarks.md counted about
//! one writer wake-up per operation when each note was a channel send).
//!
//! **Order.** Notes and durable writes share the queue, so they are applied in the order they
//! were sent, and a later write of the same record always wins.
//!
//! **Commit delay.** When durable writes arrive closer together than [`StoreOptions::commit_delay`],
//! waiting that long before committing lets the next ones share the fsync (PostgreSQL's
//! `commit_delay`, which likewise applies only when other transactions are active). A writer
//! that sees them further apart — a sequential client, a quiet node — commits at once, so a
//! lone operation never pays the delay.
//!
//! It must not interpret records, must not read the database, and must answer every waiter:
//! with the result of the commit that holds its write, or with [`CommitError::Closed`] if the
//! writer is gone.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::db::{CommitError, Op, StoreOptions};

/// A batch never holds more operations than this (memory bound under a storm): reaching it
/// commits at once.
const MAX_BATCH: usize = 8192;
/// A commit delay ends early once this many operations wait for it: more company than this
/// adds latency without saving much.
const MAX_WAITERS: usize = 64;
/// Weight of the newest gap in the moving average of the gaps between durable writes.
const GAP_WEIGHT: f64 = 0.25;

/// Told the result of the commit that holds its write.
pub(super) type Waiter = tokio::sync::oneshot::Sender<Result<(), CommitError>>;

/// What the senders have queued for the writer.
#[derive(Default)]
struct Pending {
    ops: Vec<Op>,
    waiters: Vec<Waiter>,
    /// When the first queued durable write arrived (starts the commit delay).
    first_waiter: Option<Instant>,
    /// When the first queued note arrived (starts its flush deadline).
    oldest_note: Option<Instant>,
    /// The moving average of the gaps between durable writes, and when the last one came.
    durable_gap: Option<Duration>,
    last_durable: Option<Instant>,
    /// The writer sleeps on the condvar (a sender that changes its condition must wake it).
    writer_asleep: bool,
    /// No more writes are taken: the database was dropped or the writer is gone.
    closed: bool,
}

impl Pending {
    fn note_durable_arrival(&mut self, now: Instant) {
        if let Some(last) = self.last_durable {
            let gap = now.saturating_duration_since(last);
            self.durable_gap = Some(match self.durable_gap {
                None => gap,
                Some(average) => average.mul_f64(1.0 - GAP_WEIGHT) + gap.mul_f64(GAP_WEIGHT),
            });
        }
        self.last_durable = Some(now);
    }

    /// When the writer must commit what is queued; `None` if nothing asks for a commit.
    fn due(&self, options: &StoreOptions) -> Option<Instant> {
        let now = Instant::now();
        if self.closed || self.ops.len() >= MAX_BATCH {
            return Some(now);
        }
        if let Some(first) = self.first_waiter {
            let company_expected = self
                .durable_gap
                .is_some_and(|gap| gap < options.commit_delay);
            if company_expected && self.waiters.len() < MAX_WAITERS {
                return Some(first + options.commit_delay);
            }
            return Some(now);
        }
        self.oldest_note.map(|oldest| oldest + options.note_flush)
    }
}

/// The queue between the store's callers and its writer thread.
#[derive(Default)]
pub(super) struct Queue {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").finish_non_exhaustive()
    }
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `op`, committed with a later batch.
    pub(super) fn note(&self, op: Op) -> Result<(), CommitError> {
        let mut pending = self.lock();
        if pending.closed {
            return Err(CommitError::Closed);
        }
        pending.ops.push(op);
        let first_note = pending.oldest_note.is_none();
        pending.oldest_note.get_or_insert_with(Instant::now);
        if pending.writer_asleep
            && ((first_note && pending.waiters.is_empty()) || pending.ops.len() >= MAX_BATCH)
        {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Queues `ops` and `waiter`, which is answered once the batch holding them committed.
    pub(super) fn durable(&self, ops: Vec<Op>, waiter: Waiter) -> Result<(), CommitError> {
        let mut pending = self.lock();
        if pending.closed {
            return Err(CommitError::Closed);
        }
        let now = Instant::now();
        pending.note_durable_arrival(now);
        pending.ops.extend(ops);
        pending.waiters.push(waiter);
        let first_waiter = pending.first_waiter.is_none();
        pending.first_waiter.get_or_insert(now);
        if pending.writer_asleep
            && (first_waiter
                || pending.waiters.len() >= MAX_WAITERS
                || pending.ops.len() >= MAX_BATCH)
        {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Takes no more writes; the writer commits what is queued and stops.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }

    /// The writer's side: waits until a commit is due and takes the batch. `None` once the
    /// queue is closed and empty.
    fn next_batch(&self, options: &StoreOptions) -> Option<(Vec<Op>, Vec<Waiter>)> {
        let mut pending = self.lock();
        loop {
            let due = pending.due(options);
            let now = Instant::now();
            match due {
                Some(due) if due <= now => break,
                Some(due) => {
                    pending.writer_asleep = true;
                    pending = self
                        .wake
                        .wait_timeout(pending, due - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                None => {
                    pending.writer_asleep = true;
                    pending = self
                        .wake
                        .wait(pending)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            pending.writer_asleep = false;
        }
        if pending.closed && pending.ops.is_empty() && pending.waiters.is_empty() {
            return None;
        }
        pending.first_waiter = None;
        pending.oldest_note = None;
        Some((
            std::mem::take(&mut pending.ops),
            std::mem::take(&mut pending.waiters),
        ))
    }

    /// Called when the writer stops, however it stops: refuses further writes and drops the
    /// waiters still queued, whose callers then get [`CommitError::Closed`].
    fn abandon(&self) {
        let mut pending = self.lock();
        pending.closed = true;
        pending.waiters.clear();
    }
}

/// What one commit did, for the metrics.
pub(super) struct Committed {
    /// Writes applied (after `commit` dropped the overwritten ones).
    pub ops: usize,
    pub waiters: usize,
    pub took: Duration,
}

/// The writer thread's body: commits batches with `commit` until the queue is closed and
/// drained, answering each batch's waiters with its result.
pub(super) fn run(
    queue: &Queue,
    options: StoreOptions,
    mut commit: impl FnMut(&mut Vec<Op>) -> Result<(), CommitError>,
    mut committed: impl FnMut(Committed),
) {
    struct Abandon<'a>(&'a Queue);
    impl Drop for Abandon<'_> {
        fn drop(&mut self) {
            self.0.abandon();
        }
    }
    let _abandon = Abandon(queue);
    while let Some((mut ops, waiters)) = queue.next_batch(&options) {
        let started = Instant::now();
        let result = commit(&mut ops);
        // `commit` may have dropped writes a later one overwrote: count what it applied.
        let batch_ops = ops.len();
        committed(Committed {
            ops: batch_ops,
            waiters: waiters.len(),
            took: started.elapsed(),
        });
        if let Err(err) = &result {
            tracing::error!(error = %err, operations = batch_ops, "store commit failed; its waiters get the error");
        }
        for waiter in waiters {
            let _ = waiter.send(result.clone());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::super::db::Key;
    use super::*;

    fn put(volume: &str) -> Op {
        Op::Put {
            key: Key {
                plugin_type: "t".into(),
                plugin_name: "default".into(),
                volume_key: volume.into(),
            },
            schema_version: 1,
            record: volume.into(),
        }
    }

    fn names(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, .. } | Op::Delete { key } => key.volume_key.clone(),
                Op::PutNamed { name_key, .. } | Op::DeleteNamed { name_key } => name_key.clone(),
            })
            .collect()
    }

    /// The volume names of each batch committed, in order.
    type Batches = Arc<Mutex<Vec<Vec<String>>>>;

    /// Starts a writer thread on a new queue that commits with `commit`.
    fn spawn_writer(
        options: StoreOptions,
        commit: impl FnMut(&mut Vec<Op>) -> Result<(), CommitError> + Send + 'static,
    ) -> (Arc<Queue>, std::thread::JoinHandle<()>) {
        let queue = Arc::new(Queue::default());
        let handle = {
            let queue = queue.clone();
            std::thread::spawn(move || run(&queue, options, commit, |_| {}))
        };
        (queue, handle)
    }

    /// Starts a writer that records every batch it commits.
    fn writer(options: StoreOptions) -> (Arc<Queue>, Batches, std::thread::JoinHandle<()>) {
        let batches: Batches = Arc::new(Mutex::new(Vec::new()));
        let recorded = batches.clone();
        let (queue, handle) = spawn_writer(options, move |ops| {
            recorded.lock().unwrap().push(names(ops));
            Ok(())
        });
        (queue, batches, handle)
    }

    fn durable(
        queue: &Queue,
        volume: &str,
    ) -> tokio::sync::oneshot::Receiver<Result<(), CommitError>> {
        let (done, answer) = tokio::sync::oneshot::channel();
        queue.durable(vec![put(volume)], done).unwrap();
        answer
    }

    #[test]
    fn notes_and_durable_writes_commit_in_the_order_they_were_sent() {
        let options = StoreOptions {
            note_flush: Duration::from_secs(60),
            commit_delay: Duration::ZERO,
        };
        let (queue, batches, handle) = writer(options);
        queue.note(put("a")).unwrap();
        queue.note(put("b")).unwrap();
        let answer = durable(&queue, "c");
        answer.blocking_recv().unwrap().unwrap();
        assert_eq!(*batches.lock().unwrap(), [["a", "b", "c"]]);
        queue.close();
        handle.join().unwrap();
    }

    #[test]
    fn notes_alone_wait_for_their_flush_deadline_then_commit() {
        let options = StoreOptions {
            note_flush: Duration::from_millis(200),
            commit_delay: Duration::ZERO,
        };
        let (queue, batches, handle) = writer(options);
        let sent = Instant::now();
        queue.note(put("a")).unwrap();
        queue.note(put("b")).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            batches.lock().unwrap().is_empty(),
            "committed before the deadline"
        );
        while batches.lock().unwrap().is_empty() {
            assert!(sent.elapsed() < Duration::from_secs(5), "never flushed");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(sent.elapsed() >= Duration::from_millis(200));
        assert_eq!(*batches.lock().unwrap(), [["a", "b"]]);
        queue.close();
        handle.join().unwrap();
    }

    #[test]
    fn a_lone_durable_write_does_not_pay_the_commit_delay() {
        let options = StoreOptions {
            note_flush: Duration::from_secs(60),
            commit_delay: Duration::from_millis(300),
        };
        let (queue, _batches, handle) = writer(options);
        for volume in ["a", "b", "c"] {
            let started = Instant::now();
            durable(&queue, volume).blocking_recv().unwrap().unwrap();
            assert!(
                started.elapsed() < Duration::from_millis(200),
                "{:?}",
                started.elapsed()
            );
            // Further apart than the delay: no company expected.
            std::thread::sleep(Duration::from_millis(400));
        }
        queue.close();
        handle.join().unwrap();
    }

    #[test]
    fn durable_writes_close_together_share_one_commit_within_the_delay() {
        let options = StoreOptions {
            note_flush: Duration::from_secs(60),
            commit_delay: Duration::from_millis(300),
        };
        let (queue, batches, handle) = writer(options);
        // Two close together teach the writer that company comes; they commit after the
        // delay at the latest.
        let started = Instant::now();
        let first = durable(&queue, "a");
        let second = durable(&queue, "b");
        first.blocking_recv().unwrap().unwrap();
        second.blocking_recv().unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        // Then ten arrivals 10 ms apart, all within one delay: one commit holds them all.
        let answers: Vec<_> = (0..10)
            .map(|i| {
                let answer = durable(&queue, &format!("v{i}"));
                std::thread::sleep(Duration::from_millis(10));
                answer
            })
            .collect();
        for answer in answers {
            answer.blocking_recv().unwrap().unwrap();
        }
        let batches = batches.lock().unwrap().clone();
        let last = batches.last().unwrap();
        assert_eq!(last.len(), 10, "{batches:?}");
        queue.close();
        handle.join().unwrap();
    }

    #[test]
    fn a_commit_error_reaches_every_waiter_of_its_batch() {
        let commits = Arc::new(AtomicUsize::new(0));
        let counted = commits.clone();
        let (queue, handle) = spawn_writer(StoreOptions::default(), move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
            Err(CommitError::Failpoint("test".into()))
        });
        let answer = durable(&queue, "a");
        assert!(matches!(
            answer.blocking_recv().unwrap(),
            Err(CommitError::Failpoint(_))
        ));
        queue.close();
        handle.join().unwrap();
        assert_eq!(commits.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_writer_that_dies_answers_its_waiters_and_refuses_new_writes() {
        let (queue, handle) =
            spawn_writer(StoreOptions::default(), |_| panic!("a bug in the writer"));
        queue.note(put("a")).unwrap();
        let answer = durable(&queue, "b");
        assert!(handle.join().is_err());
        // The waiter's sender was dropped with the batch: the caller sees Closed.
        assert!(answer.blocking_recv().is_err());
        assert!(matches!(queue.note(put("c")), Err(CommitError::Closed)));
        let (done, _answer) = tokio::sync::oneshot::channel();
        assert!(matches!(
            queue.durable(vec![put("d")], done),
            Err(CommitError::Closed)
        ));
    }

    #[test]
    fn closing_commits_what_is_queued_first() {
        let options = StoreOptions {
            note_flush: Duration::from_secs(60),
            commit_delay: Duration::ZERO,
        };
        let (queue, batches, handle) = writer(options);
        queue.note(put("a")).unwrap();
        queue.close();
        handle.join().unwrap();
        assert_eq!(*batches.lock().unwrap(), [["a"]]);
        assert!(matches!(queue.note(put("b")), Err(CommitError::Closed)));
    }
}
