//! The node's door for volume operations: the registry of every operation in flight, and the
//! drain's barrier (docs/operations.md, "Draining a node").
//!
//! It owns one decision: may an operation start now? Every volume operation that may reach a
//! plugin (publish, unpublish, reconcile, create, delete, the controller reads) enters the
//! gate before it takes a volume's lock or asks for a client, and leaves it when it returns,
//! however it returns. The check of the closed flag and the registration happen under one
//! lock, and [`OperationGate::close`] sets the flag under that same lock: once `close`
//! returned, no operation can start (except the drain's own, [`OperationGate::enter_draining`]),
//! so waiting until the registry is empty ([`OperationGate::wait_idle`]) really waits for the
//! last one.
//!
//! It must not run or cancel operations, nor know about plugins beyond their type (it only
//! counts and names what runs).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;

use tokio::sync::Notify;

/// One operation in flight, as the drain reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub plugin: String,
    /// Empty for operations that name no volume (capacity, backend listing).
    pub volume_id: String,
    /// `publish`, `unpublish`, `reconcile`, `create`, `delete`, …
    pub operation: &'static str,
    pub since: Instant,
}

impl fmt::Display for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} {:?} running for {:.1}s",
            self.operation,
            self.plugin,
            self.volume_id,
            self.since.elapsed().as_secs_f64()
        )
    }
}

#[derive(Debug, Default)]
struct State {
    closed: bool,
    next_id: u64,
    running: BTreeMap<u64, InFlight>,
}

/// See the module doc. One per node, shared by every plugin's volume manager.
#[derive(Debug, Default)]
pub struct OperationGate {
    state: StdMutex<State>,
    /// Woken whenever an operation leaves.
    left: Notify,
}

/// The gate is closed: the node is draining (or drained).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the node is draining (POST /v1/drain): it starts no volume operation any more; restart csi-agentd to serve again"
)]
pub struct Closed;

/// An operation's place in the registry; leaving is dropping it.
#[derive(Debug)]
pub struct Ticket {
    gate: Arc<OperationGate>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.gate.lock();
        state.running.remove(&self.id);
        drop(state);
        self.gate.left.notify_waiters();
    }
}

impl OperationGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a panicking holder; the registry is plain data.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers an operation, or refuses it when the gate is closed.
    pub fn enter(
        self: &Arc<Self>,
        plugin: &str,
        volume_id: &str,
        operation: &'static str,
    ) -> Result<Ticket, Closed> {
        let mut state = self.lock();
        if state.closed {
            return Err(Closed);
        }
        Ok(self.register(&mut state, plugin, volume_id, operation))
    }

    /// Registers one of the drain's own operations: it passes the closed gate, and is counted
    /// like any other (a later drain waits for it when this one timed out).
    pub fn enter_draining(
        self: &Arc<Self>,
        plugin: &str,
        volume_id: &str,
        operation: &'static str,
    ) -> Ticket {
        let mut state = self.lock();
        self.register(&mut state, plugin, volume_id, operation)
    }

    fn register(
        self: &Arc<Self>,
        state: &mut State,
        plugin: &str,
        volume_id: &str,
        operation: &'static str,
    ) -> Ticket {
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        state.running.insert(
            id,
            InFlight {
                plugin: plugin.to_owned(),
                volume_id: volume_id.to_owned(),
                operation,
                since: Instant::now(),
            },
        );
        Ticket {
            gate: Arc::clone(self),
            id,
        }
    }

    /// Closes the door: every later [`OperationGate::enter`] is refused. Never reopened (a
    /// restart serves again).
    pub fn close(&self) {
        self.lock().closed = true;
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Every operation in flight, oldest first.
    pub fn running(&self) -> Vec<InFlight> {
        self.lock().running.values().cloned().collect()
    }

    /// Waits until no operation is in flight, or `deadline`; calls `progress` with what still
    /// runs every `every` while it waits. Returns what still runs at the deadline (empty: idle).
    pub async fn wait_idle(
        &self,
        deadline: Instant,
        every: std::time::Duration,
        mut progress: impl FnMut(&[InFlight]),
    ) -> Vec<InFlight> {
        let mut next_report = Instant::now() + every;
        loop {
            // Registered before the check: a leave between the check and the wait still wakes.
            let notified = self.left.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let running = self.running();
            if running.is_empty() {
                return running;
            }
            let now = Instant::now();
            if now >= deadline {
                return running;
            }
            if now >= next_report {
                progress(&running);
                next_report = now + every;
            }
            let wake = deadline.min(next_report);
            let _ = tokio::time::timeout_at(wake.into(), notified).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::time::Duration;

    #[test]
    fn nothing_enters_once_closed_but_the_drain() {
        let gate = Arc::new(OperationGate::default());
        let ticket = gate.enter("p", "v", "publish").unwrap();
        gate.close();
        assert_eq!(gate.enter("p", "v", "publish").unwrap_err(), Closed);
        let drain = gate.enter_draining("p", "v", "unpublish");
        assert_eq!(gate.running().len(), 2);
        drop(ticket);
        drop(drain);
        assert!(gate.running().is_empty());
    }

    #[tokio::test]
    async fn wait_idle_waits_for_the_last_operation_and_no_longer() {
        let gate = Arc::new(OperationGate::default());
        let ticket = gate.enter("p", "v", "publish").unwrap();
        gate.close();
        let started = Instant::now();
        let left = gate
            .wait_idle(
                Instant::now() + Duration::from_millis(100),
                Duration::from_secs(1),
                |_| {},
            )
            .await;
        assert_eq!(left.len(), 1, "timed out with the publish still in flight");
        assert!(started.elapsed() >= Duration::from_millis(100));
        let holder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(ticket);
        });
        let started = Instant::now();
        let left = gate
            .wait_idle(
                Instant::now() + Duration::from_secs(10),
                Duration::from_secs(1),
                |_| {},
            )
            .await;
        assert!(left.is_empty());
        assert!(started.elapsed() < Duration::from_secs(5));
        holder.await.unwrap();
    }
}
