//! Capped, jittered exponential backoff for retrying transient CSI errors.
//!
//! Shape as in Mesos (MESOS-9517): the delay doubles from `initial` up to `max`, and each
//! sleep is drawn uniformly from `[delay/2, delay]` so that many volumes retrying against one
//! restarted plugin do not arrive in lockstep. Only computes delays; never sleeps itself.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Retry limits (configurable per plugin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// First delay.
    #[serde(with = "millis", rename = "initial_ms")]
    pub initial: Duration,
    /// Largest delay.
    #[serde(with = "millis", rename = "max_ms")]
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(10),
        }
    }
}

/// The delays of one retry sequence.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    next: Duration,
}

impl Backoff {
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            next: policy.initial.min(policy.max),
        }
    }

    /// The next delay to sleep, jittered into `[d/2, d]`.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.next;
        self.next = (self.next * 2).min(self.policy.max);
        let floor = ceiling / 2;
        let spread = ceiling.saturating_sub(floor);
        floor + spread.mul_f64(rand::random::<f64>())
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(u64::try_from(value.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(deserializer)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_jittered_and_stay_capped() {
        let policy = RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(800),
        };
        let mut backoff = Backoff::new(policy);
        let ceilings = [100, 200, 400, 800, 800, 800];
        for ceiling in ceilings {
            let delay = backoff.next_delay();
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                delay <= ceiling && delay >= ceiling / 2,
                "{delay:?} vs {ceiling:?}"
            );
        }
    }
}
