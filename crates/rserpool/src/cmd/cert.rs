//! `rserpool cert`: a test CA and certificates for trying TLS (RFC 5355) without an own PKI.
//! The CA is made once in the directory and reused for every later name, so certificates made
//! on different days trust each other.

use anyhow::{Context, Result};
use clap::Args;
use rserpool_tls::issue::{self, Issued};
use std::path::{Path, PathBuf};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CertArgs {
    /// Where to write them: ca.pem and ca.key (made if missing), NAME.pem and NAME.key.
    #[arg(long, default_value = "rserpool-certs")]
    pub dir: PathBuf,
    /// An address the certificates are valid for (repeatable; peers are checked by the IP
    /// address connected to).
    #[arg(long = "ip", value_name = "IP", default_values = ["127.0.0.1", "::1"])]
    pub ips: Vec<std::net::IpAddr>,
    /// A registrar to make a certificate for (repeatable): it carries the registrar's role
    /// (urn:rserpool:registrar), without which a PE refuses its takeovers.
    #[arg(long = "registrar", value_name = "NAME")]
    pub registrars: Vec<String>,
    /// The names to make certificates for (e.g. pe proxy user); each is also a DNS name of its
    /// certificate.
    #[arg(required_unless_present = "registrars")]
    pub names: Vec<String>,
}

fn write(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

pub fn run(args: CertArgs) -> Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("cannot create {}", args.dir.display()))?;
    let (ca_pem, ca_key) = (args.dir.join("ca.pem"), args.dir.join("ca.key"));
    let ca = if ca_pem.exists() && ca_key.exists() {
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
        };
        println!("using the CA in {}", ca_pem.display());
        Issued {
            cert_pem: read(&ca_pem)?,
            key_pem: read(&ca_key)?,
        }
    } else {
        let ca = issue::new_ca("rserpool test CA").context("cannot make a CA")?;
        write(&ca_pem, &ca.cert_pem, false)?;
        write(&ca_key, &ca.key_pem, true)?;
        println!(
            "made a CA: {} (its key: {})",
            ca_pem.display(),
            ca_key.display()
        );
        ca
    };
    let all = args
        .registrars
        .iter()
        .map(|n| (n, true))
        .chain(args.names.iter().map(|n| (n, false)));
    for (name, registrar) in all {
        let mut sans: Vec<String> = args.ips.iter().map(ToString::to_string).collect();
        for n in [name.as_str(), "localhost"] {
            if !sans.iter().any(|s| s == n) {
                sans.push(n.to_string());
            }
        }
        let cert = issue::issue_as(&ca, name, &sans, registrar)
            .with_context(|| format!("cannot make a certificate for {name}"))?;
        let (pem, key) = (
            args.dir.join(format!("{name}.pem")),
            args.dir.join(format!("{name}.key")),
        );
        write(&pem, &cert.cert_pem, false)?;
        write(&key, &cert.key_pem, true)?;
        println!(
            "{name}: {} and {} (for {}{})",
            pem.display(),
            key.display(),
            sans.join(", "),
            if registrar { "; a registrar" } else { "" }
        );
    }
    let d = args.dir.display();
    let first = args
        .registrars
        .first()
        .or(args.names.first())
        .map_or("NAME", String::as_str);
    println!();
    println!(
        "Use them with --tls-cert {d}/{first}.pem --tls-key {d}/{first}.key --tls-ca {d}/ca.pem"
    );
    Ok(())
}
