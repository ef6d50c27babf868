//! [`FixedEndpoints`]: plugin endpoints at known socket paths, for unmanaged plugins (started
//! elsewhere) and for tests.
//!
//! It connects lazily, detects the version once per endpoint and caches the client (whose
//! channel reconnects by itself after the plugin restarts on the same path). It launches
//! nothing: supervision is the service manager's.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use futures::future::BoxFuture;

use crate::client::{ClientOptions, CsiClient, RpcError};
use crate::config::Service;
use crate::volume::PluginEndpoints;

/// Endpoints at fixed socket paths.
#[derive(Debug)]
pub struct FixedEndpoints {
    sockets: HashMap<Service, PathBuf>,
    options: ClientOptions,
    clients: Mutex<HashMap<Service, CsiClient>>,
}

impl FixedEndpoints {
    /// `sockets` maps each served service to its socket.
    pub fn new(sockets: HashMap<Service, PathBuf>, options: ClientOptions) -> Self {
        Self {
            sockets,
            options,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// One socket serving both services.
    pub fn single(socket: PathBuf, options: ClientOptions) -> Self {
        let sockets = Service::ALL
            .into_iter()
            .map(|s| (s, socket.clone()))
            .collect();
        Self::new(sockets, options)
    }

    /// A socket serving only the Node service.
    pub fn node_only(socket: PathBuf, options: ClientOptions) -> Self {
        Self::new(HashMap::from([(Service::Node, socket)]), options)
    }

    fn cached(&self, service: Service) -> Option<CsiClient> {
        let clients = match self.clients.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        clients.get(&service).cloned()
    }

    fn cache(&self, service: Service, client: CsiClient) {
        let mut clients = match self.clients.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        clients.insert(service, client);
    }
}

impl PluginEndpoints for FixedEndpoints {
    fn client(&self, service: Service) -> BoxFuture<'_, Result<CsiClient, RpcError>> {
        Box::pin(async move {
            if let Some(client) = self.cached(service) {
                return Ok(client);
            }
            let Some(socket) = self.sockets.get(&service) else {
                return Err(RpcError::protocol(
                    "connect",
                    format!("no endpoint serves {}", service.as_str()),
                ));
            };
            let client = CsiClient::connect(socket, self.options.clone()).await?;
            self.cache(service, client.clone());
            Ok(client)
        })
    }

    fn serves(&self, service: Service) -> bool {
        self.sockets.contains_key(&service)
    }
}
