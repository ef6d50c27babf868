//! TLS to etcd: checks the PEM of [`TlsOptions`] once at connect (so a wrong file is refused
//! at start, naming the daemon's flag), and explains a TLS failure that the transport hides.
//!
//! Owns: the rustls configuration of the diagnostic probe and the wording of TLS failures.
//! The connections that carry requests are tonic's own (`ClientTlsConfig`, same CA and
//! identity). Must not: log or format key material.
//!
//! Why a probe: with TLS 1.3 the server judges the client's certificate after the client
//! considers the handshake done, so a missing or unknown client certificate reaches tonic as
//! "connection closed" (hyper drops the alert). When a call to an `https://` endpoint fails at
//! the transport and its error names no TLS cause, one extra handshake with the same settings
//! reads the server's alert (e.g. `CertificateRequired`) to say what is wrong.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use crate::TlsOptions;

/// The probe's settings for all endpoints (one rustls config, same trust as the channels).
#[derive(Clone)]
pub(crate) struct Probe {
    config: Arc<ClientConfig>,
    /// A client certificate is given: a certificate alert then refuses it, not its absence.
    has_identity: bool,
}

/// Checks the PEM and builds the probe's config; the error names the flag to fix.
pub(crate) fn probe_config(tls: &TlsOptions) -> Result<Probe, String> {
    let mut roots = RootCertStore::empty();
    let mut cas = 0;
    for cert in CertificateDer::pem_slice_iter(&tls.ca_pem) {
        let cert = cert.map_err(|e| {
            format!("the CA (--cluster-etcd-ca) is not valid PEM ({e}): give the PEM of the CA that signed etcd's server certificates")
        })?;
        roots.add(cert).map_err(|e| {
            format!("the CA (--cluster-etcd-ca) holds a certificate that cannot be trusted ({e})")
        })?;
        cas += 1;
    }
    if cas == 0 {
        return Err("the CA (--cluster-etcd-ca) holds no PEM certificate (-----BEGIN CERTIFICATE-----): give the PEM of the CA that signed etcd's server certificates".to_owned());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS cannot be set up: {e}"))?
        .with_root_certificates(roots);
    let mut config = match &tls.identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    format!("the client certificate (--cluster-etcd-cert) is not valid PEM ({e})")
                })?;
            if chain.is_empty() {
                return Err("the client certificate (--cluster-etcd-cert) holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned());
            }
            let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
                format!("the client key (--cluster-etcd-key) holds no usable PEM private key ({e})")
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                format!("the client certificate and key (--cluster-etcd-cert, --cluster-etcd-key) do not fit together: {e}")
            })?
        }
    };
    config.alpn_protocols.push(b"h2".to_vec());
    Ok(Probe {
        config: Arc::new(config),
        has_identity: tls.identity.is_some(),
    })
}

/// The TLS cause under `err`, if any: a rustls error carried by an I/O error.
pub(crate) fn rustls_cause(
    probe: &Probe,
    err: &(dyn std::error::Error + 'static),
) -> Option<String> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(explain(tls, probe.has_identity));
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(tls) = inner.downcast_ref::<rustls::Error>()
        {
            return Some(explain(tls, probe.has_identity));
        }
        cause = e.source();
    }
    None
}

/// A rustls error in an operator's words, naming what to check.
fn explain(err: &rustls::Error, has_identity: bool) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    let hint = match err {
        E::AlertReceived(
            A::CertificateRequired | A::BadCertificate | A::UnknownCA | A::CertificateUnknown,
        ) if !has_identity => {
            "etcd asks for a client certificate (--client-cert-auth) and none is given: give --cluster-etcd-cert and --cluster-etcd-key"
        }
        E::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            "etcd's server certificate is not signed by the CA given (--cluster-etcd-ca)"
        }
        E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
            "etcd's server certificate does not name the host of the endpoint URL (its SANs)"
        }
        E::InvalidCertificate(C::Expired | C::ExpiredContext { .. } | C::NotValidYet) => {
            "etcd's server certificate is outside its validity period"
        }
        E::InvalidCertificate(_) => "etcd's server certificate was refused",
        E::AlertReceived(A::BadCertificate | A::UnknownCA | A::CertificateUnknown) => {
            "etcd refused the client certificate (--cluster-etcd-cert): it must be signed by a CA in etcd's --trusted-ca-file"
        }
        E::AlertReceived(A::CertificateExpired) => {
            "etcd refused the client certificate (--cluster-etcd-cert) as expired"
        }
        _ => "the TLS handshake with etcd failed",
    };
    format!("{hint} ({err})")
}

/// One handshake to `host:port` with the probe's config, then one read: the server's alert,
/// if it refuses us, arrives there. `None` when TLS itself works (or the probe cannot tell).
pub(crate) async fn probe(
    probe: &Probe,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Option<String> {
    let server_name = ServerName::try_from(host.to_owned()).ok()?;
    let run = async {
        let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        let mut stream = match TlsConnector::from(probe.config.clone())
            .connect(server_name, tcp)
            .await
        {
            Ok(stream) => stream,
            Err(e) => return rustls_cause(probe, &e),
        };
        let mut byte = [0u8; 1];
        match stream.read(&mut byte).await {
            Err(e) => rustls_cause(probe, &e),
            Ok(_) => None,
        }
    };
    tokio::time::timeout(timeout, run).await.ok().flatten()
}
