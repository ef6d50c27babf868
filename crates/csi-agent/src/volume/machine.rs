//! The volume lifecycle as a pure function: given where a volume is and where its claims want
//! it, which single step comes next.
//!
//! Forward and backward resumption from every transient state is decided here and only here:
//! a transient state is repeated when going its way and undone when going the other way (an
//! uncertain NodeStage is undone by NodeUnstage; after an uncertain NodeUnstage a publish
//! stages again, k8s#86360). No I/O, no durability: the manager persists around each step.

use super::record::VolumeState;

/// The RPCs that move a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LifecycleRpc {
    ControllerPublish,
    ControllerUnpublish,
    NodeStage,
    NodeUnstage,
    NodePublish,
    NodeUnpublish,
}

impl LifecycleRpc {
    /// The transient state recorded (the intent) before the RPC is sent.
    pub fn intent(self) -> VolumeState {
        match self {
            LifecycleRpc::ControllerPublish => VolumeState::ControllerPublish,
            LifecycleRpc::ControllerUnpublish => VolumeState::ControllerUnpublish,
            LifecycleRpc::NodeStage => VolumeState::NodeStage,
            LifecycleRpc::NodeUnstage => VolumeState::NodeUnstage,
            LifecycleRpc::NodePublish => VolumeState::NodePublish,
            LifecycleRpc::NodeUnpublish => VolumeState::NodeUnpublish,
        }
    }

    /// The steady state recorded (the result) after the RPC succeeded.
    pub fn result(self) -> VolumeState {
        match self {
            LifecycleRpc::ControllerPublish => VolumeState::NodeReady,
            LifecycleRpc::ControllerUnpublish => VolumeState::Created,
            LifecycleRpc::NodeStage => VolumeState::VolReady,
            LifecycleRpc::NodeUnstage => VolumeState::NodeReady,
            LifecycleRpc::NodePublish => VolumeState::Published,
            LifecycleRpc::NodeUnpublish => VolumeState::VolReady,
        }
    }

    /// Failpoint name segment and log label.
    pub fn name(self) -> &'static str {
        match self {
            LifecycleRpc::ControllerPublish => "controller_publish",
            LifecycleRpc::ControllerUnpublish => "controller_unpublish",
            LifecycleRpc::NodeStage => "node_stage",
            LifecycleRpc::NodeUnstage => "node_unstage",
            LifecycleRpc::NodePublish => "node_publish",
            LifecycleRpc::NodeUnpublish => "node_unpublish",
        }
    }

    /// Without the `failpoints` feature no step has points, and no name is left in the binary
    /// (`scripts/check-release` looks for them).
    #[cfg(not(feature = "failpoints"))]
    pub fn failpoints(self) -> StepFailpoints {
        StepFailpoints {
            before_intent: "",
            before_rpc: "",
            after_rpc: "",
        }
    }

    /// The failpoints around this step (static names: hitting an unarmed point must cost
    /// nothing, not a string allocation).
    #[cfg(feature = "failpoints")]
    pub fn failpoints(self) -> StepFailpoints {
        macro_rules! points {
            ($step:literal) => {
                StepFailpoints {
                    before_intent: concat!("volume.", $step, ".before_intent"),
                    before_rpc: concat!("volume.", $step, ".before_rpc"),
                    after_rpc: concat!("volume.", $step, ".after_rpc"),
                }
            };
        }
        match self {
            LifecycleRpc::ControllerPublish => points!("controller_publish"),
            LifecycleRpc::ControllerUnpublish => points!("controller_unpublish"),
            LifecycleRpc::NodeStage => points!("node_stage"),
            LifecycleRpc::NodeUnstage => points!("node_unstage"),
            LifecycleRpc::NodePublish => points!("node_publish"),
            LifecycleRpc::NodeUnpublish => points!("node_unpublish"),
        }
    }

    pub const ALL: [LifecycleRpc; 6] = [
        LifecycleRpc::ControllerPublish,
        LifecycleRpc::NodeStage,
        LifecycleRpc::NodePublish,
        LifecycleRpc::NodeUnpublish,
        LifecycleRpc::NodeUnstage,
        LifecycleRpc::ControllerUnpublish,
    ];
}

/// The failpoint names of one step: before its intent is written, after the intent is
/// durable (before the RPC), and after the RPC (before its result is written).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepFailpoints {
    pub before_intent: &'static str,
    pub before_rpc: &'static str,
    pub after_rpc: &'static str,
}

/// What the plugin can do, as far as the lifecycle cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifecycleCaps {
    /// Controller `PUBLISH_UNPUBLISH_VOLUME`.
    pub controller_publish: bool,
    /// Node `STAGE_UNSTAGE_VOLUME`.
    pub stage: bool,
}

/// The next step toward the desired state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The volume is where its claims want it.
    Done,
    /// Move to another steady state without an RPC (the plugin lacks the capability).
    Skip(VolumeState),
    /// Record the RPC's intent, send it, record its result.
    Rpc(LifecycleRpc),
}

/// Decides the next step. `up` is true when the claims want the volume published.
pub fn next_step(state: VolumeState, up: bool, caps: LifecycleCaps) -> Step {
    use LifecycleRpc as R;
    use VolumeState as S;
    let gated = |enabled: bool, rpc: LifecycleRpc| {
        if enabled {
            Step::Rpc(rpc)
        } else {
            Step::Skip(rpc.result())
        }
    };
    if up {
        match state {
            S::Created | S::ControllerPublish | S::ControllerUnpublish => {
                gated(caps.controller_publish, R::ControllerPublish)
            }
            S::NodeReady | S::NodeStage | S::NodeUnstage => gated(caps.stage, R::NodeStage),
            S::VolReady | S::NodePublish | S::NodeUnpublish => Step::Rpc(R::NodePublish),
            S::Published => Step::Done,
        }
    } else {
        match state {
            S::Published | S::NodePublish | S::NodeUnpublish => Step::Rpc(R::NodeUnpublish),
            S::VolReady | S::NodeStage | S::NodeUnstage => gated(caps.stage, R::NodeUnstage),
            S::NodeReady | S::ControllerPublish | S::ControllerUnpublish => {
                gated(caps.controller_publish, R::ControllerUnpublish)
            }
            S::Created => Step::Done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_CAPS: [LifecycleCaps; 4] = [
        LifecycleCaps {
            controller_publish: false,
            stage: false,
        },
        LifecycleCaps {
            controller_publish: true,
            stage: false,
        },
        LifecycleCaps {
            controller_publish: false,
            stage: true,
        },
        LifecycleCaps {
            controller_publish: true,
            stage: true,
        },
    ];

    /// Follows steps (all RPCs succeeding) and returns the RPCs made.
    fn drive(
        mut state: VolumeState,
        up: bool,
        caps: LifecycleCaps,
    ) -> (VolumeState, Vec<LifecycleRpc>) {
        let mut rpcs = Vec::new();
        for _ in 0..10 {
            match next_step(state, up, caps) {
                Step::Done => return (state, rpcs),
                Step::Skip(to) => state = to,
                Step::Rpc(rpc) => {
                    rpcs.push(rpc);
                    state = rpc.result();
                }
            }
        }
        panic!("no convergence from {state:?}");
    }

    #[test]
    fn every_state_converges_both_ways_with_every_capability_set() {
        for caps in ALL_CAPS {
            for state in VolumeState::ALL {
                assert_eq!(drive(state, true, caps).0, VolumeState::Published);
                assert_eq!(drive(state, false, caps).0, VolumeState::Created);
            }
        }
    }

    #[test]
    fn full_publish_and_unpublish_make_the_expected_calls() {
        let caps = ALL_CAPS[3];
        assert_eq!(
            drive(VolumeState::Created, true, caps).1,
            vec![
                LifecycleRpc::ControllerPublish,
                LifecycleRpc::NodeStage,
                LifecycleRpc::NodePublish
            ]
        );
        assert_eq!(
            drive(VolumeState::Published, false, caps).1,
            vec![
                LifecycleRpc::NodeUnpublish,
                LifecycleRpc::NodeUnstage,
                LifecycleRpc::ControllerUnpublish
            ]
        );
    }

    #[test]
    fn absent_capabilities_skip_their_rpcs() {
        let (_, rpcs) = drive(VolumeState::Created, true, ALL_CAPS[0]);
        assert_eq!(rpcs, vec![LifecycleRpc::NodePublish]);
    }

    #[test]
    fn uncertain_steps_are_undone_going_down_and_repeated_going_up() {
        let caps = ALL_CAPS[3];
        // A timed-out NodeStage may have mounted: going down, it is undone by NodeUnstage.
        assert_eq!(
            next_step(VolumeState::NodeStage, false, caps),
            Step::Rpc(LifecycleRpc::NodeUnstage)
        );
        // After an uncertain NodeUnstage, a publish stages again (k8s#86360).
        assert_eq!(
            next_step(VolumeState::NodeUnstage, true, caps),
            Step::Rpc(LifecycleRpc::NodeStage)
        );
        assert_eq!(
            next_step(VolumeState::NodePublish, false, caps),
            Step::Rpc(LifecycleRpc::NodeUnpublish)
        );
        assert_eq!(
            next_step(VolumeState::ControllerPublish, false, caps),
            Step::Rpc(LifecycleRpc::ControllerUnpublish)
        );
    }
}
