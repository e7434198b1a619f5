//! ASAP messages (RFC 5352 §2.2): registration, handle resolution, keep-alive, announce, session
//! layer. Flags are per message; undefined flag bits are sent as 0 and ignored on receipt.

use crate::error::{CauseCode, DecodeError, DecodeErrorKind, EncodeError, ErrorCause};
use crate::message::Message;
use crate::param::{
    OperationError, Param, PoolElement, PoolHandle, TransportAddress, UserTransport, missing,
    parse_params, put_operation_error, put_pe_id, put_pool_element, put_pool_handle, put_transport,
};
use crate::policy::Policy;
use crate::ptype;
use crate::tlv::Encoder;
use bytes::Bytes;

/// ASAP message type codes.
pub mod msg_type {
    pub const REGISTRATION: u8 = 0x01;
    pub const DEREGISTRATION: u8 = 0x02;
    pub const REGISTRATION_RESPONSE: u8 = 0x03;
    pub const DEREGISTRATION_RESPONSE: u8 = 0x04;
    pub const HANDLE_RESOLUTION: u8 = 0x05;
    pub const HANDLE_RESOLUTION_RESPONSE: u8 = 0x06;
    pub const ENDPOINT_KEEP_ALIVE: u8 = 0x07;
    pub const ENDPOINT_KEEP_ALIVE_ACK: u8 = 0x08;
    pub const ENDPOINT_UNREACHABLE: u8 = 0x09;
    pub const SERVER_ANNOUNCE: u8 = 0x0a;
    pub const COOKIE: u8 = 0x0b;
    pub const COOKIE_ECHO: u8 = 0x0c;
    pub const BUSINESS_CARD: u8 = 0x0d;
    pub const ERROR: u8 = 0x0e;
}

use msg_type as mt;

/// An ASAP message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsapMessage {
    Registration {
        pool_handle: PoolHandle,
        pool_element: PoolElement,
    },
    Deregistration {
        pool_handle: PoolHandle,
        pe_id: u32,
    },
    RegistrationResponse {
        /// R bit: the registration was rejected (the error says why).
        reject: bool,
        pool_handle: PoolHandle,
        pe_id: u32,
        error: Option<OperationError>,
    },
    DeregistrationResponse {
        pool_handle: PoolHandle,
        pe_id: u32,
        error: Option<OperationError>,
    },
    HandleResolution {
        /// S bit: subscribe to updates for the life of the association.
        subscribe: bool,
        pool_handle: PoolHandle,
        /// rsplib's Handle Resolution Option: how many PEs the PU wants (u32::MAX = all).
        items: Option<u32>,
    },
    HandleResolutionResponse {
        /// A bit: the registrar accepted the subscription.
        accept: bool,
        pool_handle: PoolHandle,
        /// The overall pool policy; absent means Round Robin.
        policy: Option<Policy>,
        pool_elements: Vec<PoolElement>,
        /// Present in a negative response (e.g. Unknown Pool Handle).
        error: Option<OperationError>,
    },
    EndpointKeepAlive {
        /// H bit: the PE shall adopt the sender as its home registrar.
        home: bool,
        server_id: u32,
        pool_handle: PoolHandle,
        /// rsplib adds the PE Identifier of the PE addressed.
        pe_id: Option<u32>,
    },
    EndpointKeepAliveAck {
        pool_handle: PoolHandle,
        pe_id: u32,
    },
    EndpointUnreachable {
        pool_handle: PoolHandle,
        pe_id: u32,
    },
    ServerAnnounce {
        server_id: u32,
        transports: Vec<TransportAddress>,
    },
    Cookie {
        cookie: Bytes,
    },
    CookieEcho {
        cookie: Bytes,
    },
    BusinessCard {
        pool_handle: PoolHandle,
        /// rsplib adds the pool's policy.
        policy: Option<Policy>,
        pool_elements: Vec<PoolElement>,
    },
    Error {
        error: OperationError,
    },
}

impl AsapMessage {
    /// The error this message carries: an ERROR's, or a response's that says why it refuses.
    pub fn operation_error(&self) -> Option<&OperationError> {
        match self {
            Self::RegistrationResponse { error, .. }
            | Self::DeregistrationResponse { error, .. }
            | Self::HandleResolutionResponse { error, .. } => error.as_ref(),
            Self::Error { error } => Some(error),
            _ => None,
        }
    }

    pub fn msg_type(&self) -> u8 {
        match self {
            Self::Registration { .. } => mt::REGISTRATION,
            Self::Deregistration { .. } => mt::DEREGISTRATION,
            Self::RegistrationResponse { .. } => mt::REGISTRATION_RESPONSE,
            Self::DeregistrationResponse { .. } => mt::DEREGISTRATION_RESPONSE,
            Self::HandleResolution { .. } => mt::HANDLE_RESOLUTION,
            Self::HandleResolutionResponse { .. } => mt::HANDLE_RESOLUTION_RESPONSE,
            Self::EndpointKeepAlive { .. } => mt::ENDPOINT_KEEP_ALIVE,
            Self::EndpointKeepAliveAck { .. } => mt::ENDPOINT_KEEP_ALIVE_ACK,
            Self::EndpointUnreachable { .. } => mt::ENDPOINT_UNREACHABLE,
            Self::ServerAnnounce { .. } => mt::SERVER_ANNOUNCE,
            Self::Cookie { .. } => mt::COOKIE,
            Self::CookieEcho { .. } => mt::COOKIE_ECHO,
            Self::BusinessCard { .. } => mt::BUSINESS_CARD,
            Self::Error { .. } => mt::ERROR,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Registration { .. } => "REGISTRATION",
            Self::Deregistration { .. } => "DEREGISTRATION",
            Self::RegistrationResponse { .. } => "REGISTRATION_RESPONSE",
            Self::DeregistrationResponse { .. } => "DEREGISTRATION_RESPONSE",
            Self::HandleResolution { .. } => "HANDLE_RESOLUTION",
            Self::HandleResolutionResponse { .. } => "HANDLE_RESOLUTION_RESPONSE",
            Self::EndpointKeepAlive { .. } => "ENDPOINT_KEEP_ALIVE",
            Self::EndpointKeepAliveAck { .. } => "ENDPOINT_KEEP_ALIVE_ACK",
            Self::EndpointUnreachable { .. } => "ENDPOINT_UNREACHABLE",
            Self::ServerAnnounce { .. } => "SERVER_ANNOUNCE",
            Self::Cookie { .. } => "COOKIE",
            Self::CookieEcho { .. } => "COOKIE_ECHO",
            Self::BusinessCard { .. } => "BUSINESS_CARD",
            Self::Error { .. } => "ERROR",
        }
    }

    fn flags(&self) -> u8 {
        match *self {
            Self::RegistrationResponse { reject, .. } => u8::from(reject),
            Self::HandleResolution { subscribe, .. } => u8::from(subscribe),
            Self::HandleResolutionResponse { accept, .. } => u8::from(accept),
            Self::EndpointKeepAlive { home, .. } => u8::from(home),
            _ => 0,
        }
    }

    /// Appends a positive HANDLE_RESOLUTION_RESPONSE, the same bytes as encoding
    /// [`AsapMessage::HandleResolutionResponse`] without an error, but from borrowed pool
    /// elements (e.g. straight out of a handlespace, without copying them into a message).
    /// `accept`: the A bit (a subscription to the pool's updates is accepted, or this is one).
    pub fn encode_resolution<'a>(
        out: &mut Vec<u8>,
        accept: bool,
        pool_handle: &PoolHandle,
        policy: Option<&Policy>,
        pool_elements: impl IntoIterator<Item = &'a PoolElement>,
    ) -> Result<(), EncodeError> {
        let mut e = Encoder::new(out);
        let s = e.begin(u16::from_be_bytes([
            mt::HANDLE_RESOLUTION_RESPONSE,
            u8::from(accept),
        ]));
        put_pool_list(&mut e, pool_handle, policy, pool_elements);
        e.end(s);
        e.finish()
    }
}

impl Message for AsapMessage {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let mut e = Encoder::new(out);
        let s = e.begin(u16::from_be_bytes([self.msg_type(), self.flags()]));
        match self {
            Self::Registration {
                pool_handle,
                pool_element,
            } => {
                put_pool_handle(&mut e, pool_handle);
                put_pool_element(&mut e, pool_element);
            }
            Self::Deregistration { pool_handle, pe_id }
            | Self::EndpointKeepAliveAck { pool_handle, pe_id }
            | Self::EndpointUnreachable { pool_handle, pe_id } => {
                put_pool_handle(&mut e, pool_handle);
                put_pe_id(&mut e, *pe_id);
            }
            Self::RegistrationResponse {
                pool_handle,
                pe_id,
                error,
                ..
            }
            | Self::DeregistrationResponse {
                pool_handle,
                pe_id,
                error,
            } => {
                put_pool_handle(&mut e, pool_handle);
                put_pe_id(&mut e, *pe_id);
                if let Some(err) = error {
                    put_operation_error(&mut e, err);
                }
            }
            Self::HandleResolution {
                pool_handle, items, ..
            } => {
                put_pool_handle(&mut e, pool_handle);
                if let Some(n) = items {
                    e.tlv(ptype::HANDLE_RESOLUTION_OPTION, &n.to_be_bytes());
                }
            }
            Self::HandleResolutionResponse {
                pool_handle,
                policy,
                pool_elements,
                error,
                ..
            } => {
                put_pool_list(&mut e, pool_handle, policy.as_ref(), pool_elements);
                if let Some(err) = error {
                    put_operation_error(&mut e, err);
                }
            }
            Self::EndpointKeepAlive {
                server_id,
                pool_handle,
                pe_id,
                ..
            } => {
                e.u32(*server_id);
                put_pool_handle(&mut e, pool_handle);
                if let Some(id) = pe_id {
                    put_pe_id(&mut e, *id);
                }
            }
            Self::ServerAnnounce {
                server_id,
                transports,
            } => {
                e.u32(*server_id);
                transports.iter().for_each(|t| put_transport(&mut e, t));
            }
            Self::Cookie { cookie } | Self::CookieEcho { cookie } => {
                e.tlv(ptype::COOKIE, cookie);
            }
            Self::BusinessCard {
                pool_handle,
                policy,
                pool_elements,
            } => put_pool_list(&mut e, pool_handle, policy.as_ref(), pool_elements),
            Self::Error { error } => put_operation_error(&mut e, error),
        }
        e.end(s);
        e.finish()
    }

    fn decode_with_report(buf: &[u8], report: &mut Vec<ErrorCause>) -> Result<Self, DecodeError> {
        let (ty, flags, body) = crate::split_message(buf)?;
        let f0 = flags & 0x01 != 0;
        let parse = |report: &mut Vec<ErrorCause>, b: &[u8]| parse_params(b, report);
        Ok(match ty {
            mt::REGISTRATION => {
                let p = Params(parse(report, body)?);
                Self::Registration {
                    pool_handle: p.pool_handle()?,
                    pool_element: p.pool_element()?,
                }
            }
            mt::DEREGISTRATION | mt::ENDPOINT_KEEP_ALIVE_ACK | mt::ENDPOINT_UNREACHABLE => {
                let p = Params(parse(report, body)?);
                let (pool_handle, pe_id) = (p.pool_handle()?, p.pe_id()?);
                match ty {
                    mt::DEREGISTRATION => Self::Deregistration { pool_handle, pe_id },
                    mt::ENDPOINT_KEEP_ALIVE_ACK => {
                        Self::EndpointKeepAliveAck { pool_handle, pe_id }
                    }
                    _ => Self::EndpointUnreachable { pool_handle, pe_id },
                }
            }
            mt::REGISTRATION_RESPONSE | mt::DEREGISTRATION_RESPONSE => {
                let p = Params(parse(report, body)?);
                let (pool_handle, pe_id, error) = (p.pool_handle()?, p.pe_id()?, p.error());
                if ty == mt::REGISTRATION_RESPONSE {
                    Self::RegistrationResponse {
                        reject: f0,
                        pool_handle,
                        pe_id,
                        error,
                    }
                } else {
                    Self::DeregistrationResponse {
                        pool_handle,
                        pe_id,
                        error,
                    }
                }
            }
            mt::HANDLE_RESOLUTION => {
                let p = Params(parse(report, body)?);
                Self::HandleResolution {
                    subscribe: f0,
                    pool_handle: p.pool_handle()?,
                    items: p.0.iter().find_map(|x| match x {
                        Param::HandleResolutionOption(n) => Some(*n),
                        _ => None,
                    }),
                }
            }
            mt::HANDLE_RESOLUTION_RESPONSE => {
                let p = Params(parse(report, body)?);
                Self::HandleResolutionResponse {
                    accept: f0,
                    pool_handle: p.pool_handle()?,
                    policy: p.policy(),
                    pool_elements: p.pool_elements(),
                    error: p.error(),
                }
            }
            mt::ENDPOINT_KEEP_ALIVE => {
                let (server_id, rest) = fixed_u32(body, "ENDPOINT_KEEP_ALIVE")?;
                let p = Params(parse(report, rest)?);
                Self::EndpointKeepAlive {
                    home: f0,
                    server_id,
                    pool_handle: p.pool_handle()?,
                    pe_id: p.pe_id().ok(),
                }
            }
            mt::SERVER_ANNOUNCE => {
                let (server_id, rest) = fixed_u32(body, "SERVER_ANNOUNCE")?;
                let p = parse(report, rest)?;
                Self::ServerAnnounce {
                    server_id,
                    transports: p
                        .into_iter()
                        .filter_map(|x| match x {
                            Param::Transport(UserTransport::Address(t)) => Some(t),
                            _ => None,
                        })
                        .collect(),
                }
            }
            mt::COOKIE | mt::COOKIE_ECHO => {
                let p = parse(report, body)?;
                let cookie = p
                    .into_iter()
                    .find_map(|x| match x {
                        Param::Cookie(c) => Some(c),
                        _ => None,
                    })
                    .ok_or_else(|| missing("Cookie"))?;
                if ty == mt::COOKIE {
                    Self::Cookie { cookie }
                } else {
                    Self::CookieEcho { cookie }
                }
            }
            mt::BUSINESS_CARD => {
                let p = Params(parse(report, body)?);
                Self::BusinessCard {
                    pool_handle: p.pool_handle()?,
                    policy: p.policy(),
                    pool_elements: p.pool_elements(),
                }
            }
            mt::ERROR => {
                let p = Params(parse(report, body)?);
                Self::Error {
                    error: p.error().ok_or_else(|| missing("Operation Error"))?,
                }
            }
            other => return Err(crate::unknown_message(other, buf)),
        })
    }
}

/// Reads the fixed 32-bit field (a server ID) that some messages carry before their TLVs.
pub(crate) fn fixed_u32<'a>(
    body: &'a [u8],
    what: &'static str,
) -> Result<(u32, &'a [u8]), DecodeError> {
    match body {
        [a, b, c, d, rest @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        _ => Err(DecodeError {
            kind: DecodeErrorKind::InvalidValue(what),
            cause: Some(ErrorCause::new(CauseCode::INVALID_VALUES)),
        }),
    }
}

/// A message's decoded parameters, with lookups for the ones a message needs.
pub(crate) struct Params(pub Vec<Param>);

impl Params {
    pub fn pool_handle(&self) -> Result<PoolHandle, DecodeError> {
        self.0
            .iter()
            .find_map(|x| match x {
                Param::PoolHandle(h) => Some(h.clone()),
                _ => None,
            })
            .ok_or_else(|| missing("Pool Handle"))
    }

    pub fn pe_id(&self) -> Result<u32, DecodeError> {
        self.0
            .iter()
            .find_map(|x| match x {
                Param::PeId(id) => Some(*id),
                _ => None,
            })
            .ok_or_else(|| missing("PE Identifier"))
    }

    pub fn pool_element(&self) -> Result<PoolElement, DecodeError> {
        self.0
            .iter()
            .find_map(|x| match x {
                Param::PoolElement(pe) => Some(pe.clone()),
                _ => None,
            })
            .ok_or_else(|| missing("Pool Element"))
    }

    pub fn pool_elements(&self) -> Vec<PoolElement> {
        self.0
            .iter()
            .filter_map(|x| match x {
                Param::PoolElement(pe) => Some(pe.clone()),
                _ => None,
            })
            .collect()
    }

    pub fn policy(&self) -> Option<Policy> {
        self.0.iter().find_map(|x| match x {
            Param::Policy(p) => Some(p.clone()),
            _ => None,
        })
    }

    pub fn error(&self) -> Option<OperationError> {
        self.0.iter().find_map(|x| match x {
            Param::OperationError(e) => Some(e.clone()),
            _ => None,
        })
    }
}

/// A pool handle, the pool's policy and its elements: the body of a resolution response and of
/// a business card.
fn put_pool_list<'a>(
    e: &mut Encoder<'_>,
    pool_handle: &PoolHandle,
    policy: Option<&Policy>,
    pool_elements: impl IntoIterator<Item = &'a PoolElement>,
) {
    put_pool_handle(e, pool_handle);
    if let Some(p) = policy {
        p.encode(e);
    }
    pool_elements
        .into_iter()
        .for_each(|pe| put_pool_element(e, pe));
}
