//! TLS with mutual authentication for ASAP and ENRP (RFC 5355 §3), on rustls.
//!
//! Why it exists: RFC 5355 asks that registrars and pool elements authenticate each other
//! with certificates, so that nobody on the path can register a PE, forge a handle update or
//! take over a pool. Every rserpool process that speaks ASAP or ENRP loads the same three
//! files ([`TlsFiles`]: its certificate chain, its key and the CA that signs its peers) into
//! one [`Tls`], which gives the rustls configurations for both sides of a connection:
//! - a registrar's ENRP port and a PE's takeover port *require* a client certificate from the
//!   CA ([`Tls::server`] with `require_client = true`);
//! - a registrar's ASAP port asks for one but lets a pool user without one in; the registrar
//!   then refuses that connection's registrations (cause 0xa, Rejected due to security
//!   considerations), so a PE without a valid certificate cannot register;
//! - every client presents its certificate and checks the server's against the CA, by the IP
//!   address it connected to (certificates carry their IP addresses as SANs; `rserpool cert`
//!   makes them so).
//!
//! One crypto provider, *ring*, is named explicitly for every configuration ([`provider`]);
//! rustls refuses to pick one by itself when two are compiled in.

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use rustls;
#[cfg(feature = "tokio")]
pub use tokio_rustls;

#[cfg(feature = "issue")]
pub mod issue;

/// The URI a registrar's certificate carries as a subject alternative name. A PE follows a
/// takeover (RFC 5353 §3.5) over TLS only from a certificate that has it: any certificate
/// of the CA — a PE's, a pool user's — could claim to be a registrar otherwise (RFC 5355
/// §3.1). `rserpool cert --registrar NAME` issues such certificates; with an own CA, add it
/// to each registrar's certificate as a URI SAN.
pub const REGISTRAR_URI: &str = "urn:rserpool:registrar";

/// Whether the certificate `der` carries [`REGISTRAR_URI`] among its subject alternative
/// names.
pub fn is_registrar(der: &[u8]) -> bool {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return false;
    };
    san.value
        .general_names
        .iter()
        .any(|n| matches!(n, GeneralName::URI(u) if *u == REGISTRAR_URI))
}

/// The files of a TLS identity, as a config file or the command line names them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TlsFiles {
    /// This process's certificate (PEM; its chain may follow it).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, SEC1 or PKCS#1).
    pub key: PathBuf,
    /// The CA certificate(s) its peers' certificates must chain to (PEM).
    pub ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, String),
    #[error("{0}: no certificate in it")]
    NoCertificate(PathBuf),
    #[error("{0}: {1}")]
    Config(String, String),
}

/// The crypto provider of every configuration made here: *ring*, with the AES-128-GCM suites
/// (SHA-256) ahead of AES-256-GCM (SHA-384). Current x86 and ARM CPUs compute SHA-256 in
/// hardware and SHA-384 not: a handshake's transcript hash and key schedule, and every
/// record, cost less (the SHA-384 code took an eighth of the proxy's CPU on new HTTPS
/// connections). Servers here pick by this order ([`prefer_ours`]).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    let sha384 = |s: &rustls::SupportedCipherSuite| format!("{:?}", s.suite()).ends_with("SHA384");
    p.cipher_suites.sort_by_key(sha384);
    Arc::new(p)
}

/// A server configuration that picks the cipher suite by [`provider`]'s order, not the
/// client's (which usually puts AES-256 first).
fn prefer_ours(mut cfg: ServerConfig) -> ServerConfig {
    cfg.ignore_client_order = true;
    cfg
}

/// Installs [`provider`] as the process default, for any rustls user that does not name one.
/// Call once at start; later calls change nothing.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One process's TLS identity and trust, ready to make connections with.
#[derive(Clone)]
pub struct Tls {
    server_required: Arc<ServerConfig>,
    server_optional: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls { .. }")
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read(path.to_owned(), e.to_string()))
}

/// The certificates of a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Read(path.to_owned(), e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_owned()));
    }
    Ok(certs)
}

/// The CA certificates of a PEM file, as trust roots.
fn roots(ca: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(ca)? {
        roots
            .add(c)
            .map_err(|e| TlsError::Config(ca.display().to_string(), format!("not a CA: {e}")))?;
    }
    Ok(roots)
}

/// The private key of a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Read(path.to_owned(), e.to_string()))
}

impl Tls {
    /// Loads the files and checks that they make a usable identity.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let certs = load_certs(&files.cert)?;
        let key = load_key(&files.key)?;
        let roots = Arc::new(roots(&files.ca)?);
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            TlsError::Config(files.cert.display().to_string(), format!("{what}: {e}"))
        };
        let server = |verifier| {
            ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| bad("protocol versions", &e))?
                .with_client_cert_verifier(verifier)
                .with_single_cert(certs.clone(), key.clone_key())
                .map(|c| Arc::new(prefer_ours(c)))
                .map_err(|e| bad("certificate and key", &e))
        };
        let verifier = |optional: bool| {
            let b = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider());
            let b = if optional {
                b.allow_unauthenticated()
            } else {
                b
            };
            b.build().map_err(|e| bad("client verifier", &e))
        };
        let client = client_config(roots.clone(), Some((certs.clone(), key.clone_key())))
            .map_err(|e| bad("certificate and key", &e))?;
        Ok(Self {
            server_required: server(verifier(false)?)?,
            server_optional: server(verifier(true)?)?,
            client,
        })
    }

    /// The configuration of the accepting side; `require_client`: a peer without a
    /// certificate from the CA fails the handshake (else it may come in unauthenticated).
    pub fn server(&self, require_client: bool) -> Arc<ServerConfig> {
        if require_client {
            self.server_required.clone()
        } else {
            self.server_optional.clone()
        }
    }

    /// The configuration of the connecting side: it presents this identity and checks the
    /// server's certificate for the address connected to.
    pub fn client(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// The name a server at `ip` is checked for: its IP address.
    pub fn server_name(ip: IpAddr) -> ServerName<'static> {
        ServerName::IpAddress(ip.into())
    }

    /// A rustls server connection for an accepted socket.
    pub fn accept(&self, require_client: bool) -> Result<rustls::ServerConnection, rustls::Error> {
        rustls::ServerConnection::new(self.server(require_client))
    }

    /// A rustls client connection towards `ip`.
    pub fn connect(&self, ip: IpAddr) -> Result<rustls::ClientConnection, rustls::Error> {
        rustls::ClientConnection::new(self.client(), Self::server_name(ip))
    }
}

type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// A client configuration trusting `roots`, presenting `identity` when given.
fn client_config(
    roots: Arc<RootCertStore>,
    identity: Option<Identity>,
) -> Result<Arc<ClientConfig>, rustls::Error> {
    let b = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    Ok(Arc::new(match identity {
        Some((certs, key)) => b.with_client_auth_cert(certs, key)?,
        None => b.with_no_client_auth(),
    }))
}

/// TLS towards servers whose certificates chain to `ca` (checked for the IP address
/// connected to), presenting `cert` and `key` when given: the proxy's TLS to its PEs.
pub fn client_to(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = roots(ca)?;
    let identity = match identity {
        Some((cert, key)) => Some((load_certs(cert)?, load_key(key)?)),
        None => None,
    };
    client_config(Arc::new(roots), identity)
        .map_err(|e| TlsError::Config(ca.display().to_string(), e.to_string()))
}

/// A short, stable description of why a handshake failed, for a log line.
pub fn describe(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateHandshakeMessage { .. } => {
            format!("not TLS, or broken TLS ({e}); a plaintext client on a TLS port?")
        }
        rustls::Error::NoCertificatesPresented => {
            "no client certificate presented (one from the configured CA is required)".into()
        }
        rustls::Error::InvalidCertificate(c) => format!("certificate refused: {c:?}"),
        rustls::Error::AlertReceived(a) => {
            format!("the peer refused the handshake (alert {a:?}): does it trust our CA?")
        }
        other => other.to_string(),
    }
}

#[cfg(feature = "tokio")]
mod stream {
    use super::Tls;
    use std::net::IpAddr;
    use tokio::net::TcpStream;

    impl Tls {
        /// The TLS handshake as a client over `stream`, towards `ip`.
        pub async fn connect_stream(
            &self,
            ip: IpAddr,
            stream: TcpStream,
        ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
            tokio_rustls::TlsConnector::from(self.client())
                .connect(Self::server_name(ip), stream)
                .await
        }

        /// The TLS handshake as a server over an accepted `stream`.
        pub async fn accept_stream(
            &self,
            require_client: bool,
            stream: TcpStream,
        ) -> std::io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
            tokio_rustls::TlsAcceptor::from(self.server(require_client))
                .accept(stream)
                .await
        }
    }
}

/// One certificate a TLS listener offers, and the names (SNI) it is offered for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Certificate {
    /// The certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The server names it is for (`www.example.org`, `*.example.org`); a client asking for
    /// none of the names configured gets the first certificate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
}

/// Picks a listener's certificate by the name the client asks for (SNI): an exact name, then
/// a wildcard one level up, then the first certificate.
#[derive(Debug)]
struct BySni {
    by_name: std::collections::HashMap<String, Arc<rustls::sign::CertifiedKey>>,
    default: Arc<rustls::sign::CertifiedKey>,
}

impl rustls::server::ResolvesServerCert for BySni {
    fn resolve(
        &self,
        hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let Some(name) = hello.server_name() else {
            return Some(self.default.clone());
        };
        let name = name.to_ascii_lowercase();
        let wildcard = name.split_once('.').map(|(_, up)| format!("*.{up}"));
        self.by_name
            .get(&name)
            .or_else(|| wildcard.and_then(|w| self.by_name.get(&w)))
            .or(Some(&self.default))
            .cloned()
    }
}

/// TLS 1.2 sessions an HTTPS listener remembers for resumption.
const HTTPS_SESSION_CACHE: usize = 20_000;

/// ALPN for an HTTPS listener that speaks HTTP/2 and HTTP/1.1 (HTTP/2 preferred).
pub const ALPN_H2_HTTP1: &[&[u8]] = &[b"h2", b"http/1.1"];
/// ALPN for an HTTPS listener that speaks HTTP/1.1 only.
pub const ALPN_HTTP1: &[&[u8]] = &[b"http/1.1"];

/// The configuration of a TLS listener terminating HTTPS: its certificates by SNI, the
/// protocols of `alpn` (in order of preference, e.g. [`ALPN_H2_HTTP1`]), no client
/// certificates.
pub fn https_server(certs: &[Certificate], alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let mut by_name = std::collections::HashMap::new();
    let mut default = None;
    for c in certs {
        let chain = load_certs(&c.cert)?;
        let key = provider
            .key_provider
            .load_private_key(load_key(&c.key)?)
            .map_err(|e| TlsError::Config(c.key.display().to_string(), e.to_string()))?;
        let ck = Arc::new(rustls::sign::CertifiedKey::new(chain, key));
        ck.keys_match()
            .map_err(|e| TlsError::Config(c.cert.display().to_string(), e.to_string()))?;
        for n in &c.names {
            by_name.insert(n.to_ascii_lowercase(), ck.clone());
        }
        default.get_or_insert(ck);
    }
    let Some(default) = default else {
        return Err(TlsError::Config(
            "listener".into(),
            "TLS needs at least one certificate".into(),
        ));
    };
    let mut cfg = prefer_ours(
        ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config("listener".into(), e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(BySni { by_name, default })),
    );
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // Resumption: clients that come back skip the certificate and its signature; stateless
    // tickets (keys rotated by rustls), and a session cache for TLS 1.2 session IDs.
    cfg.ticketer = rustls::crypto::ring::Ticketer::new()
        .map_err(|e| TlsError::Config("listener".into(), format!("session tickets: {e}")))?;
    cfg.session_storage = rustls::server::ServerSessionMemoryCache::new(HTTPS_SESSION_CACHE);
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sha256_suites_come_first() {
        let p = super::provider();
        let names: Vec<String> = p
            .cipher_suites
            .iter()
            .map(|s| format!("{:?}", s.suite()))
            .collect();
        assert_eq!(names[0], "TLS13_AES_128_GCM_SHA256", "{names:?}");
        let first384 = names
            .iter()
            .position(|n| n.ends_with("SHA384"))
            .unwrap_or(names.len());
        assert!(names[..first384].iter().all(|n| !n.ends_with("SHA384")));
        assert!(
            names[first384..].iter().all(|n| n.ends_with("SHA384")),
            "{names:?}"
        );
    }
}
