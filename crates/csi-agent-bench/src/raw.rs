//! The two in-process contenders: the raw CSI RPC sequence (what a minimal CO does, with
//! no durability of its own) and csi-agent's engine ([`VolumeManager`]) in-process.
//!
//! The raw sequence is the baseline every ratio is taken against. It uses the same client
//! code as the engine ([`CsiClient`], one HTTP/2 connection, version detected once) and
//! does exactly what the CSI spec requires of the CO around the RPCs: create the staging
//! directory and the target's parent before NodeStage/NodePublish, and remove what it
//! created after NodeUnstage. It keeps nothing durable, checks nothing after the RPCs and
//! caches the node id (asked once with NodeGetInfo) like the engine does.
//!
//! [`Raw::with_durable_writes`] is a diagnostic contender: the raw sequence plus the
//! engine's record writes, inline, with nothing else of the engine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use csi_agent::client::{ClientOptions, CsiClient};
use csi_agent::endpoints::FixedEndpoints;
use csi_agent::layout::Layout;
use csi_agent::metrics::Metrics;
use csi_agent::store::Store;
use csi_agent::volume::{
    AccessMode, AccessType, Capability, NodeContext, Origin, PublishRequest, VolumeConfig,
    VolumeManager, VolumeRecord, VolumeSecrets, VolumeState,
};
use csi_proto::v1;

pub fn capability() -> Capability {
    Capability {
        access_type: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: Vec::new(),
        },
        access_mode: AccessMode::SingleNodeWriter,
    }
}

fn client_options(plugin_type: &str, metrics: Option<Arc<Metrics>>) -> ClientOptions {
    ClientOptions {
        rpc_deadline: Duration::from_secs(30),
        plugin: plugin_type.to_owned(),
        metrics,
    }
}

/// The raw RPC sequence against one plugin socket.
#[derive(Clone, Debug)]
pub struct Raw {
    client: CsiClient,
    /// RPC latencies only (a raw CO has no metrics; this costs a few atomic operations).
    pub metrics: Arc<Metrics>,
    /// Root of the CO's staging and target dirs.
    root: PathBuf,
    stage: bool,
    /// `Some` when the plugin needs ControllerPublish (the node id from NodeGetInfo).
    node_id: Option<String>,
    capability: v1::VolumeCapability,
    /// Set by [`Raw::with_durable_writes`]: the same durable record writes as the engine,
    /// inline and synchronous, around the same RPCs.
    durable: Option<Arc<Durable>>,
}

#[derive(Debug)]
struct Durable {
    store: Store,
    record: VolumeRecord,
}

const DURABLE_TYPE: &str = "org.example.raw-durable";

impl Raw {
    /// A copy of this client that also writes a volume record durably before each RPC
    /// (intent) and after the last one (result), like the engine (a step's result and the
    /// next intent share one write), and deletes it at the end of an unpublish.
    pub fn with_durable_writes(&self, work_dir: &Path) -> anyhow::Result<Self> {
        let store = Store::open(Layout::new(work_dir), None)?;
        let mut record = VolumeRecord::new("raw-durable", Origin::PreProvisioned);
        record.state = VolumeState::Published;
        record.claims.insert("bench-workload".to_owned());
        record.capability = Some(capability());
        record.boot_id = Some("00000000-0000-0000-0000-000000000000".to_owned());
        Ok(Self {
            durable: Some(Arc::new(Durable { store, record })),
            ..self.clone()
        })
    }

    fn checkpoint(&self, volume_id: &str) -> anyhow::Result<()> {
        if let Some(d) = &self.durable {
            d.store
                .save_volume(DURABLE_TYPE, "default", volume_id, &d.record)?;
        }
        Ok(())
    }

    fn forget(&self, volume_id: &str) -> anyhow::Result<()> {
        if let Some(d) = &self.durable {
            d.store.delete_volume(DURABLE_TYPE, "default", volume_id)?;
        }
        Ok(())
    }
    /// Connects (detecting the version) and asks the capabilities and, if the plugin needs
    /// ControllerPublish, the node id, once — as any CO would.
    pub async fn connect(socket: &Path, root: PathBuf, plugin_type: &str) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let client = CsiClient::connect(socket, client_options(plugin_type, Some(metrics.clone())))
            .await
            .with_context(|| format!("cannot connect to {}", socket.display()))?;
        let stage = client
            .node_get_capabilities()
            .await?
            .contains(&v1::node_service_capability::rpc::Type::StageUnstageVolume);
        let controller_publish = client
            .controller_get_capabilities()
            .await?
            .contains(&v1::controller_service_capability::rpc::Type::PublishUnpublishVolume);
        let node_id = if controller_publish {
            Some(client.node_get_info().await?.node_id)
        } else {
            None
        };
        std::fs::create_dir_all(&root)?;
        Ok(Self {
            client,
            metrics,
            root,
            stage,
            node_id,
            capability: capability().to_v1(),
            durable: None,
        })
    }

    fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.root.join(volume_id)
    }

    fn staging(&self, volume_id: &str) -> PathBuf {
        self.volume_dir(volume_id).join("staging")
    }

    fn target(&self, volume_id: &str) -> PathBuf {
        self.volume_dir(volume_id).join("target")
    }

    /// [ControllerPublish,] mkdir staging, NodeStage, NodePublish (the target's parent is the
    /// volume dir, created with the staging dir).
    pub async fn publish(&self, volume_id: &str) -> anyhow::Result<()> {
        let mut publish_context = HashMap::new();
        self.checkpoint(volume_id)?;
        if let Some(node_id) = &self.node_id {
            publish_context = self
                .client
                .controller_publish_volume(v1::ControllerPublishVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    node_id: node_id.clone(),
                    volume_capability: Some(self.capability.clone()),
                    readonly: false,
                    ..Default::default()
                })
                .await?
                .publish_context;
            self.checkpoint(volume_id)?;
        }
        let staging = self.staging(volume_id);
        if self.stage {
            std::fs::create_dir_all(&staging)?;
            self.client
                .node_stage_volume(v1::NodeStageVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    publish_context: publish_context.clone(),
                    staging_target_path: path_string(&staging),
                    volume_capability: Some(self.capability.clone()),
                    ..Default::default()
                })
                .await?;
            self.checkpoint(volume_id)?;
        } else {
            std::fs::create_dir_all(self.volume_dir(volume_id))?;
        }
        self.client
            .node_publish_volume(v1::NodePublishVolumeRequest {
                volume_id: volume_id.to_owned(),
                publish_context,
                staging_target_path: if self.stage {
                    path_string(&staging)
                } else {
                    String::new()
                },
                target_path: path_string(&self.target(volume_id)),
                volume_capability: Some(self.capability.clone()),
                readonly: false,
                ..Default::default()
            })
            .await?;
        self.checkpoint(volume_id)?;
        Ok(())
    }

    /// NodeUnpublish, NodeUnstage, rmdir staging and the volume dir, [ControllerUnpublish].
    pub async fn unpublish(&self, volume_id: &str) -> anyhow::Result<()> {
        self.checkpoint(volume_id)?;
        self.client
            .node_unpublish_volume(v1::NodeUnpublishVolumeRequest {
                volume_id: volume_id.to_owned(),
                target_path: path_string(&self.target(volume_id)),
            })
            .await?;
        if self.stage {
            self.checkpoint(volume_id)?;
            let staging = self.staging(volume_id);
            self.client
                .node_unstage_volume(v1::NodeUnstageVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    staging_target_path: path_string(&staging),
                })
                .await?;
            std::fs::remove_dir(&staging)?;
        }
        std::fs::remove_dir(self.volume_dir(volume_id))?;
        if let Some(node_id) = &self.node_id {
            self.checkpoint(volume_id)?;
            self.client
                .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    node_id: node_id.clone(),
                    ..Default::default()
                })
                .await?;
        }
        self.forget(volume_id)?;
        Ok(())
    }
}

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// csi-agent's engine in-process: a [`VolumeManager`] with its own work dir and metrics,
/// talking to the plugin socket through [`FixedEndpoints`] (one cached client).
#[derive(Clone, Debug)]
pub struct Engine {
    pub manager: VolumeManager,
    pub metrics: Arc<Metrics>,
}

impl Engine {
    pub fn new(work_dir: &Path, socket: &Path, plugin_type: &str) -> anyhow::Result<Self> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .context("cannot read the boot id")?
            .trim()
            .to_owned();
        let metrics = Arc::new(Metrics::new());
        let layout = Layout::new(work_dir);
        let store = Store::open(layout.clone(), Some(metrics.clone()))?;
        let endpoints = FixedEndpoints::single(
            socket.to_path_buf(),
            client_options(plugin_type, Some(metrics.clone())),
        );
        let mut context = NodeContext::new(layout, store, boot_id);
        context.metrics = Some(metrics.clone());
        let manager = VolumeManager::new(
            VolumeConfig::new(plugin_type, "default"),
            Arc::new(endpoints),
            context,
        );
        Ok(Self { manager, metrics })
    }

    pub fn writes(&self) -> u64 {
        self.metrics.checkpoint_writes.get()
    }

    pub async fn publish(&self, volume_id: &str, workload: &str) -> anyhow::Result<()> {
        let published = self
            .manager
            .publish(PublishRequest {
                volume_id: volume_id.to_owned(),
                workload: workload.to_owned(),
                capability: capability(),
                readonly: false,
                volume_context: None,
                secrets: VolumeSecrets::default(),
                bind_to: None,
            })
            .await
            .with_context(|| format!("engine publish of {volume_id}"))?;
        if published.state != csi_agent::volume::VolumeState::Published {
            bail!(
                "engine publish of {volume_id} ended in {:?}",
                published.state
            );
        }
        Ok(())
    }

    pub async fn unpublish(&self, volume_id: &str, workload: &str) -> anyhow::Result<()> {
        self.manager
            .unpublish(volume_id, workload)
            .await
            .with_context(|| format!("engine unpublish of {volume_id}"))
    }
}
