//! A CA and certificates to try TLS with (`rserpool cert`, the tests): ECDSA P-256, each
//! certificate valid as server and as client (ASAP and ENRP authenticate both ends), with its
//! IP addresses and names as subject alternative names. For production, certificates come
//! from the operator's own CA; these are for a lab and a quick start.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
};

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

fn named(mut p: CertificateParams, name: &str) -> CertificateParams {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn.push(DnType::OrganizationName, "rserpool test CA");
    p.distinguished_name = dn;
    p
}

/// A new self-signed CA. Its name gets a random suffix: two test CAs never pass for each
/// other (a certificate of the other is then an unknown issuer, not a bad signature).
pub fn new_ca(name: &str) -> Result<Issued, rcgen::Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let tag: String = key.public_key_raw()[1..5]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut p = named(
        CertificateParams::new(Vec::<String>::new())?,
        &format!("{name} {tag}"),
    );
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A certificate for `name` signed by `ca`, valid for `sans` (IP addresses or DNS names).
pub fn issue(ca: &Issued, name: &str, sans: &[String]) -> Result<Issued, rcgen::Error> {
    issue_as(ca, name, sans, false)
}

/// [`issue`], for a registrar when `registrar` (it carries [`crate::REGISTRAR_URI`]: PEs
/// follow its takeovers).
pub fn issue_as(
    ca: &Issued,
    name: &str,
    sans: &[String],
    registrar: bool,
) -> Result<Issued, rcgen::Error> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let mut p = named(CertificateParams::new(sans.to_vec())?, name);
    if registrar {
        p.subject_alt_names
            .push(rcgen::SanType::URI(crate::REGISTRAR_URI.try_into()?));
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

#[cfg(test)]
mod role_tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, pem::PemObject};

    #[test]
    fn a_registrars_certificate_says_so_and_no_other_does() {
        let ca = new_ca("role test").unwrap();
        let sans = ["127.0.0.1".to_string(), "r1".to_string()];
        let der = |i: &Issued| CertificateDer::from_pem_slice(i.cert_pem.as_bytes()).unwrap();
        let registrar = issue_as(&ca, "r1", &sans, true).unwrap();
        assert!(crate::is_registrar(&der(&registrar)));
        let pe = issue(&ca, "pe", &sans).unwrap();
        assert!(!crate::is_registrar(&der(&pe)));
        assert!(!crate::is_registrar(b"not a certificate"));
    }
}
