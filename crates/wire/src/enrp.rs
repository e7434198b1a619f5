//! ENRP messages (RFC 5353 §2): registrar-to-registrar handlespace synchronisation. Every
//! message carries the sending and receiving server IDs after the header.

use crate::asap::{Params, fixed_u32};
use crate::error::{DecodeError, DecodeErrorKind, EncodeError, ErrorCause};
use crate::message::Message;
use crate::param::{
    OperationError, Param, PoolElement, PoolHandle, ServerInformation, missing, parse_params,
    put_operation_error, put_pool_element, put_pool_handle, put_server_information,
};
use crate::ptype;
use crate::tlv::Encoder;

/// ENRP message type codes.
pub mod msg_type {
    pub const PRESENCE: u8 = 0x01;
    pub const HANDLE_TABLE_REQUEST: u8 = 0x02;
    pub const HANDLE_TABLE_RESPONSE: u8 = 0x03;
    pub const HANDLE_UPDATE: u8 = 0x04;
    pub const LIST_REQUEST: u8 = 0x05;
    pub const LIST_RESPONSE: u8 = 0x06;
    pub const INIT_TAKEOVER: u8 = 0x07;
    pub const INIT_TAKEOVER_ACK: u8 = 0x08;
    pub const TAKEOVER_SERVER: u8 = 0x09;
    pub const ERROR: u8 = 0x0a;
}

use msg_type as mt;

/// HANDLE_UPDATE's action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpdateAction {
    AddPe,
    DelPe,
}

/// One pool's entries in a HANDLE_TABLE_RESPONSE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEntry {
    pub pool_handle: PoolHandle,
    pub pool_elements: Vec<PoolElement>,
}

/// An ENRP message: sender, receiver (0 = group-cast) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrpMessage {
    pub sender: u32,
    pub receiver: u32,
    pub body: EnrpBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrpBody {
    Presence {
        /// R bit: the receiver must answer with a PRESENCE carrying Server Information.
        reply_required: bool,
        checksum: Option<u16>,
        server_info: Option<ServerInformation>,
    },
    HandleTableRequest {
        /// W bit: only the receiver's own PEs.
        own_children_only: bool,
    },
    HandleTableResponse {
        /// R bit: rejected.
        reject: bool,
        /// M bit: more to send.
        more: bool,
        pools: Vec<PoolEntry>,
    },
    HandleUpdate {
        /// T bit (draft-dreibholz-rserpool-enrp-takeover): takeover suggested.
        takeover_suggested: bool,
        action: UpdateAction,
        pool_handle: PoolHandle,
        pool_element: PoolElement,
    },
    ListRequest,
    ListResponse {
        reject: bool,
        servers: Vec<ServerInformation>,
    },
    InitTakeover {
        target: u32,
    },
    InitTakeoverAck {
        target: u32,
    },
    TakeoverServer {
        target: u32,
    },
    Error {
        error: OperationError,
    },
}

impl EnrpBody {
    pub fn msg_type(&self) -> u8 {
        match self {
            Self::Presence { .. } => mt::PRESENCE,
            Self::HandleTableRequest { .. } => mt::HANDLE_TABLE_REQUEST,
            Self::HandleTableResponse { .. } => mt::HANDLE_TABLE_RESPONSE,
            Self::HandleUpdate { .. } => mt::HANDLE_UPDATE,
            Self::ListRequest => mt::LIST_REQUEST,
            Self::ListResponse { .. } => mt::LIST_RESPONSE,
            Self::InitTakeover { .. } => mt::INIT_TAKEOVER,
            Self::InitTakeoverAck { .. } => mt::INIT_TAKEOVER_ACK,
            Self::TakeoverServer { .. } => mt::TAKEOVER_SERVER,
            Self::Error { .. } => mt::ERROR,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Presence { .. } => "PRESENCE",
            Self::HandleTableRequest { .. } => "HANDLE_TABLE_REQUEST",
            Self::HandleTableResponse { .. } => "HANDLE_TABLE_RESPONSE",
            Self::HandleUpdate { .. } => "HANDLE_UPDATE",
            Self::ListRequest => "LIST_REQUEST",
            Self::ListResponse { .. } => "LIST_RESPONSE",
            Self::InitTakeover { .. } => "INIT_TAKEOVER",
            Self::InitTakeoverAck { .. } => "INIT_TAKEOVER_ACK",
            Self::TakeoverServer { .. } => "TAKEOVER_SERVER",
            Self::Error { .. } => "ERROR",
        }
    }

    fn flags(&self) -> u8 {
        match *self {
            Self::Presence { reply_required, .. } => u8::from(reply_required),
            Self::HandleTableRequest { own_children_only } => u8::from(own_children_only),
            Self::HandleTableResponse { reject, more, .. } => {
                u8::from(reject) | u8::from(more) << 1
            }
            Self::HandleUpdate {
                takeover_suggested, ..
            } => u8::from(takeover_suggested),
            Self::ListResponse { reject, .. } => u8::from(reject),
            _ => 0,
        }
    }
}

impl Message for EnrpMessage {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let mut e = Encoder::new(out);
        let s = e.begin(u16::from_be_bytes([
            self.body.msg_type(),
            self.body.flags(),
        ]));
        e.u32(self.sender);
        e.u32(self.receiver);
        match &self.body {
            EnrpBody::Presence {
                checksum,
                server_info,
                ..
            } => {
                if let Some(c) = checksum {
                    // The checksum's value is 16 bits plus 2 bytes of padding (length 6).
                    e.tlv(ptype::PE_CHECKSUM, &c.to_be_bytes());
                }
                if let Some(si) = server_info {
                    put_server_information(&mut e, si);
                }
            }
            EnrpBody::HandleTableRequest { .. } | EnrpBody::ListRequest => {}
            EnrpBody::HandleTableResponse { pools, .. } => {
                for p in pools {
                    put_pool_handle(&mut e, &p.pool_handle);
                    p.pool_elements
                        .iter()
                        .for_each(|pe| put_pool_element(&mut e, pe));
                }
            }
            EnrpBody::HandleUpdate {
                action,
                pool_handle,
                pool_element,
                ..
            } => {
                e.u16(match action {
                    UpdateAction::AddPe => 0,
                    UpdateAction::DelPe => 1,
                });
                e.u16(0);
                put_pool_handle(&mut e, pool_handle);
                put_pool_element(&mut e, pool_element);
            }
            EnrpBody::ListResponse { servers, .. } => {
                servers
                    .iter()
                    .for_each(|si| put_server_information(&mut e, si));
            }
            EnrpBody::InitTakeover { target }
            | EnrpBody::InitTakeoverAck { target }
            | EnrpBody::TakeoverServer { target } => e.u32(*target),
            EnrpBody::Error { error } => put_operation_error(&mut e, error),
        }
        e.end(s);
        e.finish()
    }

    fn decode_with_report(buf: &[u8], report: &mut Vec<ErrorCause>) -> Result<Self, DecodeError> {
        let (ty, flags, body) = crate::split_message(buf)?;
        if !(mt::PRESENCE..=mt::ERROR).contains(&ty) {
            return Err(crate::unknown_message(ty, buf));
        }
        let (sender, rest) = fixed_u32(body, "ENRP sending server ID")?;
        let (receiver, rest) = fixed_u32(rest, "ENRP receiving server ID")?;
        let f0 = flags & 0x01 != 0;
        let body = match ty {
            mt::PRESENCE => {
                let p = Params(parse_params(rest, report)?);
                EnrpBody::Presence {
                    reply_required: f0,
                    checksum: p.0.iter().find_map(|x| match x {
                        Param::PeChecksum(c) => Some(*c),
                        _ => None,
                    }),
                    server_info: p.0.iter().find_map(|x| match x {
                        Param::ServerInformation(si) => Some(si.clone()),
                        _ => None,
                    }),
                }
            }
            mt::HANDLE_TABLE_REQUEST => EnrpBody::HandleTableRequest {
                own_children_only: f0,
            },
            mt::HANDLE_TABLE_RESPONSE => {
                let mut pools: Vec<PoolEntry> = Vec::new();
                for p in parse_params(rest, report)? {
                    match p {
                        Param::PoolHandle(h) => pools.push(PoolEntry {
                            pool_handle: h,
                            pool_elements: Vec::new(),
                        }),
                        Param::PoolElement(pe) => match pools.last_mut() {
                            Some(entry) => entry.pool_elements.push(pe),
                            None => return Err(missing("Pool Handle before Pool Element")),
                        },
                        _ => {}
                    }
                }
                EnrpBody::HandleTableResponse {
                    reject: f0,
                    more: flags & 0x02 != 0,
                    pools,
                }
            }
            mt::HANDLE_UPDATE => {
                let (word, rest) = fixed_u32(rest, "HANDLE_UPDATE action")?;
                let action = match word >> 16 {
                    0 => UpdateAction::AddPe,
                    1 => UpdateAction::DelPe,
                    _ => {
                        return Err(DecodeError::invalid(
                            DecodeErrorKind::InvalidValue("HANDLE_UPDATE action"),
                            &buf[12..16],
                        ));
                    }
                };
                let p = Params(parse_params(rest, report)?);
                EnrpBody::HandleUpdate {
                    takeover_suggested: f0,
                    action,
                    pool_handle: p.pool_handle()?,
                    pool_element: p.pool_element()?,
                }
            }
            mt::LIST_REQUEST => EnrpBody::ListRequest,
            mt::LIST_RESPONSE => EnrpBody::ListResponse {
                reject: f0,
                servers: parse_params(rest, report)?
                    .into_iter()
                    .filter_map(|x| match x {
                        Param::ServerInformation(si) => Some(si),
                        _ => None,
                    })
                    .collect(),
            },
            mt::INIT_TAKEOVER | mt::INIT_TAKEOVER_ACK | mt::TAKEOVER_SERVER => {
                let (target, _) = fixed_u32(rest, "takeover target server ID")?;
                match ty {
                    mt::INIT_TAKEOVER => EnrpBody::InitTakeover { target },
                    mt::INIT_TAKEOVER_ACK => EnrpBody::InitTakeoverAck { target },
                    _ => EnrpBody::TakeoverServer { target },
                }
            }
            _ => EnrpBody::Error {
                error: Params(parse_params(rest, report)?)
                    .error()
                    .ok_or_else(|| missing("Operation Error"))?,
            },
        };
        Ok(Self {
            sender,
            receiver,
            body,
        })
    }
}
