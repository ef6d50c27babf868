//! `Watch/Watch`: a stream of the changes to one key or one prefix, so that a caller waiting
//! for a change wakes when it is made instead of reading again and again.
//!
//! Owns opening one watch (tried on each endpoint like a read, bounded by the request timeout:
//! the call returns once etcd confirmed the watch, so no change after the start revision is
//! missed) and reading its events. It must not decide what a change means, and it never
//! re-opens a watch on its own: a watch that ends (its member died, etcd cancelled it, the
//! revision was compacted) is an error, and the caller reads the current value and opens a new
//! one. Each message is bounded by tonic's decoding limit (4 MiB); a waiting caller bounds its
//! own wait.

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::pb::etcdserverpb as rpc;
use crate::pb::mvccpb;
use crate::{Client, EtcdError, KeyValue, Kind, prefix_end, with_token};

/// What happened to a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// Written: the value as it is now.
    Put(KeyValue),
    /// Deleted (or its lease expired): the key, and the revision of the deletion as its
    /// `mod_revision`.
    Delete(KeyValue),
}

/// An open watch; dropping it ends the stream (etcd then drops the watcher).
pub struct Watch {
    responses: tonic::Streaming<rpc::WatchResponse>,
    /// The request side is kept open while the watch lives: the stream's end would be a
    /// client going away.
    _requests: mpsc::Sender<rpc::WatchRequest>,
    endpoint: String,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Watches exactly `key` (or, with `prefix`, every key starting with it) for changes at
    /// and after `start_revision` (0: from now on). Returns once etcd has created the watch.
    pub async fn watch(
        &self,
        key: &[u8],
        prefix: bool,
        start_revision: i64,
    ) -> Result<Watch, EtcdError> {
        let create = rpc::WatchRequest {
            request_union: Some(rpc::watch_request::RequestUnion::CreateRequest(
                rpc::WatchCreateRequest {
                    key: key.to_vec(),
                    range_end: if prefix { prefix_end(key) } else { Vec::new() },
                    start_revision,
                    ..Default::default()
                },
            )),
        };
        let endpoints = self.inner.endpoints.clone();
        let opened = self
            .call("Watch", Kind::Read, |ch, token| {
                let create = create.clone();
                let endpoints = endpoints.clone();
                async move {
                    let (requests, rx) = mpsc::channel(1);
                    requests
                        .send(create)
                        .await
                        .map_err(|_| tonic::Status::internal("watch request not queued"))?;
                    let mut responses = rpc::watch_client::WatchClient::new(ch)
                        .watch(with_token(ReceiverStream::new(rx), token))
                        .await?
                        .into_inner();
                    // The first answer confirms the watch (or says why there is none).
                    match responses.message().await? {
                        Some(first) if first.created && !first.canceled => {}
                        Some(first) => {
                            return Err(tonic::Status::failed_precondition(format!(
                                "etcd did not create the watch: {}",
                                reason(&first)
                            )));
                        }
                        None => {
                            return Err(tonic::Status::unavailable(
                                "Watch stream closed before the watch was created",
                            ));
                        }
                    }
                    Ok(tonic::Response::new((
                        responses,
                        requests,
                        endpoints.join(","),
                    )))
                }
            })
            .await?;
        let (responses, requests, endpoint) = opened;
        Ok(Watch {
            responses,
            _requests: requests,
            endpoint,
        })
    }
}

impl Watch {
    /// Waits for the next changes (at least one). An error means the watch is over: the caller
    /// reads what is current and, if it still wants to, opens another.
    pub async fn changes(&mut self) -> Result<Vec<WatchEvent>, EtcdError> {
        loop {
            // A broken stream surfaces as whatever h2 saw (often `Unknown`): any error here
            // means this watch is over, whatever its code.
            let message =
                self.responses
                    .message()
                    .await
                    .map_err(|status| EtcdError::WatchEnded {
                        endpoint: self.endpoint.clone(),
                        reason: format!("{:?}: {}", status.code(), status.message()),
                    })?;
            let Some(response) = message else {
                return Err(EtcdError::WatchEnded {
                    endpoint: self.endpoint.clone(),
                    reason: "the stream closed".to_owned(),
                });
            };
            if response.canceled {
                return Err(EtcdError::WatchEnded {
                    endpoint: self.endpoint.clone(),
                    reason: reason(&response),
                });
            }
            let events: Vec<WatchEvent> = response
                .events
                .into_iter()
                .filter_map(|event| {
                    let kv = KeyValue::from(event.kv?);
                    Some(match mvccpb::event::EventType::try_from(event.r#type) {
                        Ok(mvccpb::event::EventType::Delete) => WatchEvent::Delete(kv),
                        _ => WatchEvent::Put(kv),
                    })
                })
                .collect();
            // A progress notice (no events) is not a change.
            if !events.is_empty() {
                return Ok(events);
            }
        }
    }
}

/// Why etcd cancelled (or did not create) a watch.
fn reason(response: &rpc::WatchResponse) -> String {
    if response.compact_revision > 0 {
        format!(
            "the start revision was compacted (oldest kept: {})",
            response.compact_revision
        )
    } else if response.cancel_reason.is_empty() {
        "cancelled".to_owned()
    } else {
        response.cancel_reason.clone()
    }
}
