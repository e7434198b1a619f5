//! Parameter type codes (RFC 5354 §3, and draft-dreibholz-rserpool-asap-hropt for 0x803f), apart
//! from the parameters themselves because the policy parameter (`policy`) and every
//! other parameter (`param`) need them both.

pub const IPV4_ADDRESS: u16 = 0x0001;
pub const IPV6_ADDRESS: u16 = 0x0002;
pub const DCCP_TRANSPORT: u16 = 0x0003;
pub const SCTP_TRANSPORT: u16 = 0x0004;
pub const TCP_TRANSPORT: u16 = 0x0005;
pub const UDP_TRANSPORT: u16 = 0x0006;
pub const UDP_LITE_TRANSPORT: u16 = 0x0007;
pub const POLICY: u16 = 0x0008;
pub const POOL_HANDLE: u16 = 0x0009;
pub const POOL_ELEMENT: u16 = 0x000a;
pub const SERVER_INFORMATION: u16 = 0x000b;
pub const OPERATION_ERROR: u16 = 0x000c;
pub const COOKIE: u16 = 0x000d;
pub const PE_IDENTIFIER: u16 = 0x000e;
pub const PE_CHECKSUM: u16 = 0x000f;
pub const OPAQUE_TRANSPORT: u16 = 0x0010;
pub const HANDLE_RESOLUTION_OPTION: u16 = 0x803f;
