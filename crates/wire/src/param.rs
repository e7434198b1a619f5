//! RSerPool parameters (RFC 5354 §3): typed values and their TLV encoding.

use crate::error::{DecodeError, DecodeErrorKind, ErrorCause};
use crate::policy::Policy;
use crate::ptype;
use crate::tlv::{Encoder, RawTlv, Reader, TlvIter, unknown_parameter};
use bytes::Bytes;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A pool handle: an opaque byte string naming a pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PoolHandle(pub Bytes);

impl PoolHandle {
    pub fn new(b: impl Into<Bytes>) -> Self {
        Self(b.into())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<&str> for PoolHandle {
    fn from(s: &str) -> Self {
        Self(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl std::fmt::Display for PoolHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) if s.chars().all(|c| !c.is_control()) => f.write_str(s),
            _ => {
                f.write_str("0x")?;
                self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

/// The transport protocol of a transport parameter, with its protocol-specific field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// SCTP, with its Transport Use field (0 = data only, 1 = data plus control).
    Sctp {
        transport_use: u16,
    },
    /// TCP; the reserved field is kept as received (rsplib reads it as Transport Use).
    Tcp {
        reserved: u16,
    },
    Udp {
        reserved: u16,
    },
    UdpLite {
        reserved: u16,
    },
    Dccp {
        reserved: u16,
        service_code: u32,
    },
}

impl Protocol {
    pub const TCP: Self = Self::Tcp { reserved: 0 };
    pub const SCTP_DATA_ONLY: Self = Self::Sctp { transport_use: 0 };
    pub const SCTP_DATA_CONTROL: Self = Self::Sctp { transport_use: 1 };

    fn ptype(self) -> u16 {
        match self {
            Self::Sctp { .. } => ptype::SCTP_TRANSPORT,
            Self::Tcp { .. } => ptype::TCP_TRANSPORT,
            Self::Udp { .. } => ptype::UDP_TRANSPORT,
            Self::UdpLite { .. } => ptype::UDP_LITE_TRANSPORT,
            Self::Dccp { .. } => ptype::DCCP_TRANSPORT,
        }
    }

    /// True if two transports are of the same type and use, the registrar's consistency rule.
    pub fn same_kind(self, other: Self) -> bool {
        match (self, other) {
            (Self::Sctp { transport_use: a }, Self::Sctp { transport_use: b }) => a == b,
            _ => std::mem::discriminant(&self) == std::mem::discriminant(&other),
        }
    }
}

/// The addresses of a transport parameter; one address (the common case) is stored inline, so
/// a registered PE costs no extra allocation for it.
pub type Addresses = smallvec::SmallVec<[IpAddr; 1]>;

/// A transport parameter: protocol, port and one or more addresses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TransportAddress {
    pub protocol: Protocol,
    pub port: u16,
    pub addresses: Addresses,
}

impl TransportAddress {
    pub fn tcp(addr: std::net::SocketAddr) -> Self {
        Self {
            protocol: Protocol::TCP,
            port: addr.port(),
            addresses: smallvec::smallvec![addr.ip()],
        }
    }
}

impl TransportAddress {
    /// The socket addresses this transport names (one per address).
    pub fn socket_addrs(&self) -> impl Iterator<Item = std::net::SocketAddr> + '_ {
        self.addresses
            .iter()
            .map(|&ip| std::net::SocketAddr::new(ip, self.port))
    }
}

impl std::fmt::Display for TransportAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.protocol {
            Protocol::Sctp { .. } => "sctp",
            Protocol::Tcp { .. } => "tcp",
            Protocol::Udp { .. } => "udp",
            Protocol::UdpLite { .. } => "udplite",
            Protocol::Dccp { .. } => "dccp",
        };
        f.write_str(proto)?;
        for (i, a) in self.socket_addrs().enumerate() {
            f.write_str(if i == 0 { " " } else { "," })?;
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

impl std::fmt::Display for UserTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Address(t) => t.fmt(f),
            Self::Opaque(b) => write!(f, "opaque ({} bytes)", b.len()),
        }
    }
}

/// The user transport of a pool element: an address transport or an opaque one (0x10).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum UserTransport {
    Address(TransportAddress),
    Opaque(Bytes),
}

impl UserTransport {
    /// The transport's TCP address, if it is one: what a pool user that connects over TCP can
    /// reach (a PE over SCTP, UDP or an opaque transport it cannot).
    pub fn tcp(&self) -> Option<&TransportAddress> {
        match self {
            Self::Address(t) if matches!(t.protocol, Protocol::Tcp { .. }) => Some(t),
            _ => None,
        }
    }

    pub fn ptype(&self) -> u16 {
        match self {
            Self::Address(t) => t.protocol.ptype(),
            Self::Opaque(_) => ptype::OPAQUE_TRANSPORT,
        }
    }
}

/// The Pool Element parameter (RFC 5354 §3.3.5).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolElement {
    pub id: u32,
    /// Home registrar's server ID; 0 = unknown.
    pub home_registrar: u32,
    /// Registration life; -1 = infinite. (RFC: seconds; rsplib: milliseconds.)
    pub registration_life: i32,
    pub user_transport: UserTransport,
    pub policy: Policy,
    /// Filled in by the registrar from the PE's association; absent in a PE's REGISTRATION.
    pub asap_transport: Option<TransportAddress>,
}

/// The Server Information parameter (RFC 5354 §3.3.6).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServerInformation {
    pub server_id: u32,
    pub transport: TransportAddress,
}

/// The Operation Error parameter: one or more error causes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct OperationError {
    pub causes: Vec<ErrorCause>,
}

impl OperationError {
    pub fn single(cause: ErrorCause) -> Self {
        Self {
            causes: vec![cause],
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding

pub(crate) fn put_pool_handle(e: &mut Encoder<'_>, h: &PoolHandle) {
    e.tlv(ptype::POOL_HANDLE, h.as_bytes());
}

pub(crate) fn put_pe_id(e: &mut Encoder<'_>, id: u32) {
    e.tlv(ptype::PE_IDENTIFIER, &id.to_be_bytes());
}

fn put_ip(e: &mut Encoder<'_>, a: &IpAddr) {
    match a {
        IpAddr::V4(v4) => e.tlv(ptype::IPV4_ADDRESS, &v4.octets()),
        IpAddr::V6(v6) => e.tlv(ptype::IPV6_ADDRESS, &v6.octets()),
    }
}

pub(crate) fn put_transport(e: &mut Encoder<'_>, t: &TransportAddress) {
    let s = e.begin(t.protocol.ptype());
    e.u16(t.port);
    match t.protocol {
        Protocol::Sctp { transport_use: r }
        | Protocol::Tcp { reserved: r }
        | Protocol::Udp { reserved: r }
        | Protocol::UdpLite { reserved: r } => e.u16(r),
        Protocol::Dccp {
            reserved,
            service_code,
        } => {
            e.u16(reserved);
            e.u32(service_code);
        }
    }
    for a in &t.addresses {
        put_ip(e, a);
    }
    e.end(s);
}

pub(crate) fn put_user_transport(e: &mut Encoder<'_>, t: &UserTransport) {
    match t {
        UserTransport::Address(a) => put_transport(e, a),
        UserTransport::Opaque(b) => e.tlv(ptype::OPAQUE_TRANSPORT, b),
    }
}

pub(crate) fn put_pool_element(e: &mut Encoder<'_>, pe: &PoolElement) {
    let s = e.begin(ptype::POOL_ELEMENT);
    e.u32(pe.id);
    e.u32(pe.home_registrar);
    e.u32(pe.registration_life as u32);
    put_user_transport(e, &pe.user_transport);
    pe.policy.encode(e);
    if let Some(a) = &pe.asap_transport {
        put_transport(e, a);
    }
    e.end(s);
}

pub(crate) fn put_server_information(e: &mut Encoder<'_>, si: &ServerInformation) {
    let s = e.begin(ptype::SERVER_INFORMATION);
    e.u32(si.server_id);
    put_transport(e, &si.transport);
    e.end(s);
}

pub(crate) fn put_operation_error(e: &mut Encoder<'_>, oe: &OperationError) {
    let s = e.begin(ptype::OPERATION_ERROR);
    for c in &oe.causes {
        // Error causes share the TLV layout: code, length (excluding padding), info.
        e.tlv(c.code.0, &c.info);
    }
    e.end(s);
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// A decoded parameter, as found at message level.
#[derive(Debug, Clone)]
pub(crate) enum Param {
    PoolHandle(PoolHandle),
    PoolElement(PoolElement),
    PeId(u32),
    Policy(Policy),
    Transport(UserTransport),
    ServerInformation(ServerInformation),
    OperationError(OperationError),
    Cookie(Bytes),
    PeChecksum(u16),
    HandleResolutionOption(u32),
    /// A known parameter that carries nothing the message needs (e.g. a stray address).
    Ignored,
}

pub(crate) fn parse_params(
    buf: &[u8],
    report: &mut Vec<ErrorCause>,
) -> Result<Vec<Param>, DecodeError> {
    let mut out = Vec::new();
    for tlv in TlvIter::new(buf) {
        let tlv = tlv?;
        out.push(parse_param(&tlv, report)?);
    }
    Ok(out)
}

fn parse_param(tlv: &RawTlv<'_>, report: &mut Vec<ErrorCause>) -> Result<Param, DecodeError> {
    Ok(match tlv.ptype {
        ptype::POOL_HANDLE => Param::PoolHandle(PoolHandle(Bytes::copy_from_slice(tlv.value))),
        ptype::POOL_ELEMENT => Param::PoolElement(parse_pool_element(tlv, report)?),
        ptype::PE_IDENTIFIER => {
            Param::PeId(Reader::new(tlv.value, "PE Identifier", tlv.whole).u32()?)
        }
        ptype::POLICY => Param::Policy(Policy::decode(tlv)?),
        ptype::DCCP_TRANSPORT
        | ptype::SCTP_TRANSPORT
        | ptype::TCP_TRANSPORT
        | ptype::UDP_TRANSPORT
        | ptype::UDP_LITE_TRANSPORT
        | ptype::OPAQUE_TRANSPORT => Param::Transport(parse_user_transport(tlv, report)?),
        ptype::SERVER_INFORMATION => {
            let mut r = Reader::new(tlv.value, "Server Information", tlv.whole);
            let server_id = r.u32()?;
            let mut transport = None;
            for p in parse_params(r.rest(), report)? {
                if let (Param::Transport(UserTransport::Address(t)), None) = (p, &transport) {
                    transport = Some(t);
                }
            }
            let transport = transport.ok_or_else(|| missing("Server Information transport"))?;
            Param::ServerInformation(ServerInformation {
                server_id,
                transport,
            })
        }
        ptype::OPERATION_ERROR => Param::OperationError(parse_operation_error(tlv)?),
        ptype::COOKIE => Param::Cookie(Bytes::copy_from_slice(tlv.value)),
        ptype::PE_CHECKSUM => {
            Param::PeChecksum(Reader::new(tlv.value, "PE Checksum", tlv.whole).u16()?)
        }
        ptype::HANDLE_RESOLUTION_OPTION => Param::HandleResolutionOption(
            Reader::new(tlv.value, "Handle Resolution Option", tlv.whole).u32()?,
        ),
        ptype::IPV4_ADDRESS | ptype::IPV6_ADDRESS => {
            parse_ip(tlv)?;
            Param::Ignored
        }
        _ => {
            unknown_parameter(tlv, report)?;
            Param::Ignored
        }
    })
}

pub(crate) fn missing(what: &'static str) -> DecodeError {
    DecodeError {
        kind: DecodeErrorKind::MissingParameter(what),
        cause: Some(ErrorCause::new(crate::error::CauseCode::INVALID_VALUES)),
    }
}

fn parse_ip(tlv: &RawTlv<'_>) -> Result<IpAddr, DecodeError> {
    let mut r = Reader::new(tlv.value, "IP address", tlv.whole);
    match tlv.ptype {
        ptype::IPV4_ADDRESS => Ok(IpAddr::V4(Ipv4Addr::from(r.bytes::<4>()?))),
        _ => Ok(IpAddr::V6(Ipv6Addr::from(r.bytes::<16>()?))),
    }
}

fn parse_user_transport(
    tlv: &RawTlv<'_>,
    report: &mut Vec<ErrorCause>,
) -> Result<UserTransport, DecodeError> {
    if tlv.ptype == ptype::OPAQUE_TRANSPORT {
        return Ok(UserTransport::Opaque(Bytes::copy_from_slice(tlv.value)));
    }
    let mut r = Reader::new(tlv.value, "transport parameter", tlv.whole);
    let port = r.u16()?;
    let field = r.u16()?;
    let protocol = match tlv.ptype {
        ptype::SCTP_TRANSPORT => Protocol::Sctp {
            transport_use: field,
        },
        ptype::TCP_TRANSPORT => Protocol::Tcp { reserved: field },
        ptype::UDP_TRANSPORT => Protocol::Udp { reserved: field },
        ptype::UDP_LITE_TRANSPORT => Protocol::UdpLite { reserved: field },
        _ => Protocol::Dccp {
            reserved: field,
            service_code: r.u32()?,
        },
    };
    let mut addresses = Addresses::new();
    for inner in TlvIter::new(r.rest()) {
        let inner = inner?;
        match inner.ptype {
            ptype::IPV4_ADDRESS | ptype::IPV6_ADDRESS => addresses.push(parse_ip(&inner)?),
            _ => unknown_parameter(&inner, report)?,
        }
    }
    if addresses.is_empty() {
        return Err(r.invalid());
    }
    Ok(UserTransport::Address(TransportAddress {
        protocol,
        port,
        addresses,
    }))
}

fn parse_pool_element(
    tlv: &RawTlv<'_>,
    report: &mut Vec<ErrorCause>,
) -> Result<PoolElement, DecodeError> {
    let mut r = Reader::new(tlv.value, "Pool Element", tlv.whole);
    let id = r.u32()?;
    let home_registrar = r.u32()?;
    let registration_life = r.i32()?;
    let mut user_transport = None;
    let mut policy = None;
    let mut asap_transport = None;
    for p in parse_params(r.rest(), report)? {
        match p {
            Param::Transport(t) if user_transport.is_none() => user_transport = Some(t),
            Param::Transport(UserTransport::Address(t)) if asap_transport.is_none() => {
                asap_transport = Some(t)
            }
            Param::Policy(p) if policy.is_none() => policy = Some(p),
            _ => {}
        }
    }
    Ok(PoolElement {
        id,
        home_registrar,
        registration_life,
        user_transport: user_transport.ok_or_else(|| missing("user transport"))?,
        policy: policy.ok_or_else(|| missing("Pool Member Selection Policy"))?,
        asap_transport,
    })
}

fn parse_operation_error(tlv: &RawTlv<'_>) -> Result<OperationError, DecodeError> {
    let mut causes = Vec::new();
    // Causes have the TLV layout, but every code is known here: no top-bit rules apply.
    for c in TlvIter::new(tlv.value) {
        let c = c?;
        causes.push(ErrorCause::with_info(
            crate::error::CauseCode(c.ptype),
            Bytes::copy_from_slice(c.value),
        ));
    }
    Ok(OperationError { causes })
}

impl UserTransport {
    /// This transport as a standalone TLV (e.g. for an Inconsistent Transport Type cause).
    pub fn to_tlv(&self) -> Vec<u8> {
        let mut v = Vec::new();
        put_user_transport(&mut Encoder::new(&mut v), self);
        v
    }
}

impl Policy {
    /// This policy as a standalone TLV (e.g. for an Inconsistent Pooling Policy cause).
    pub fn to_tlv(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut Encoder::new(&mut v));
        v
    }
}
