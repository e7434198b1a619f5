//! The state cookie (RFC 9260 §5.1.3): what a listening endpoint would otherwise have to keep
//! about a half-open association, sent to the peer in INIT ACK and back in COOKIE ECHO,
//! signed with HMAC-SHA256 under the endpoint's secret so that no memory is spent before the
//! peer proves it receives at its address (the SYN-flood defence of the four-way handshake).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What the association is made of once the cookie comes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CookieState {
    pub local_tag: u32,
    pub local_tsn: u32,
    pub peer_tag: u32,
    pub peer_tsn: u32,
    pub peer_rwnd: u32,
    /// Streams each way, as negotiated.
    pub outbound: u16,
    pub inbound: u16,
    pub local_port: u16,
    pub peer_port: u16,
    /// When the INIT ACK was made, ms on the endpoint's clock.
    pub created_ms: u64,
    /// The addresses the peer's INIT listed (at most [`MAX_PEER_ADDRESSES`]): its other paths.
    pub peer_addrs: Vec<IpAddr>,
}

/// Addresses of a peer kept in a cookie, and paths of an association: more is a peer
/// that wants us to probe addresses for it.
pub const MAX_PEER_ADDRESSES: usize = 8;

const BODY: usize = 4 * 5 + 2 * 4 + 8;
const MAC: usize = 32;
/// A cookie's length without peer addresses (one byte counts them).
pub const COOKIE_LEN: usize = BODY + 1 + MAC;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CookieError {
    #[error("a state cookie of {0} bytes does not parse")]
    Length(usize),
    #[error("the state cookie's signature is wrong")]
    Signature,
    #[error("the state cookie is stale ({0} ms past its life)")]
    Stale(u64),
}

impl CookieState {
    pub fn seal(&self, secret: &[u8; 32]) -> Vec<u8> {
        let mut b = Vec::with_capacity(COOKIE_LEN);
        for v in [
            self.local_tag,
            self.local_tsn,
            self.peer_tag,
            self.peer_tsn,
            self.peer_rwnd,
        ] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        for v in [self.outbound, self.inbound, self.local_port, self.peer_port] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b.extend_from_slice(&self.created_ms.to_be_bytes());
        let addrs = &self.peer_addrs[..self.peer_addrs.len().min(MAX_PEER_ADDRESSES)];
        b.push(addrs.len() as u8);
        for a in addrs {
            match a {
                IpAddr::V4(v4) => {
                    b.push(4);
                    b.extend_from_slice(&v4.octets());
                }
                IpAddr::V6(v6) => {
                    b.push(6);
                    b.extend_from_slice(&v6.octets());
                }
            }
        }
        let tag = mac(secret, &b);
        b.extend_from_slice(&tag);
        b
    }

    /// The state in `cookie` if it is ours, unaltered, and younger than `life_ms` at `now_ms`.
    pub fn open(
        cookie: &[u8],
        secret: &[u8; 32],
        now_ms: u64,
        life_ms: u64,
    ) -> Result<Self, CookieError> {
        if cookie.len() < COOKIE_LEN {
            return Err(CookieError::Length(cookie.len()));
        }
        let (body, tag) = cookie.split_at(cookie.len() - MAC);
        let mut m = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| CookieError::Signature)?;
        m.update(body);
        m.verify_slice(tag).map_err(|_| CookieError::Signature)?;
        // Signed by us, so well formed; checked all the same.
        let mut peer_addrs = Vec::new();
        let mut rest = &body[BODY + 1..];
        while let Some((&family, tail)) = rest.split_first() {
            let (ip, tail) = match (family, tail.len()) {
                (4, n) if n >= 4 => {
                    let o: [u8; 4] = [tail[0], tail[1], tail[2], tail[3]];
                    (IpAddr::V4(Ipv4Addr::from(o)), &tail[4..])
                }
                (6, n) if n >= 16 => {
                    let mut o = [0u8; 16];
                    o.copy_from_slice(&tail[..16]);
                    (IpAddr::V6(Ipv6Addr::from(o)), &tail[16..])
                }
                _ => return Err(CookieError::Length(cookie.len())),
            };
            peer_addrs.push(ip);
            rest = tail;
        }
        if peer_addrs.len() != usize::from(body[BODY]) {
            return Err(CookieError::Length(cookie.len()));
        }
        let u32_at =
            |i: usize| u32::from_be_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
        let u16_at = |i: usize| u16::from_be_bytes([body[i], body[i + 1]]);
        let mut created = [0u8; 8];
        created.copy_from_slice(&body[28..36]);
        let s = Self {
            local_tag: u32_at(0),
            local_tsn: u32_at(4),
            peer_tag: u32_at(8),
            peer_tsn: u32_at(12),
            peer_rwnd: u32_at(16),
            outbound: u16_at(20),
            inbound: u16_at(22),
            local_port: u16_at(24),
            peer_port: u16_at(26),
            created_ms: u64::from_be_bytes(created),
            peer_addrs,
        };
        let age = now_ms.saturating_sub(s.created_ms);
        if age > life_ms {
            return Err(CookieError::Stale(age - life_ms));
        }
        Ok(s)
    }
}

fn mac(secret: &[u8; 32], body: &[u8]) -> [u8; MAC] {
    // HMAC takes a key of any length: this cannot fail.
    let mut m = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => return [0; MAC],
    };
    m.update(body);
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cookie_opens_only_unaltered_in_time_and_under_its_secret() {
        let s = CookieState {
            local_tag: 1,
            local_tsn: 2,
            peer_tag: 3,
            peer_tsn: 4,
            peer_rwnd: 5,
            outbound: 6,
            inbound: 7,
            local_port: 8,
            peer_port: 9,
            created_ms: 1000,
            peer_addrs: vec!["192.0.2.7".parse().unwrap(), "2001:db8::7".parse().unwrap()],
        };
        let key = [7u8; 32];
        let c = s.seal(&key);
        assert_eq!(c.len(), COOKIE_LEN + 5 + 17);
        assert_eq!(CookieState::open(&c, &key, 1500, 60_000), Ok(s.clone()));
        assert_eq!(
            CookieState::open(&c, &key, 62_000, 60_000),
            Err(CookieError::Stale(1000))
        );
        assert_eq!(
            CookieState::open(&c, &[8u8; 32], 1500, 60_000),
            Err(CookieError::Signature)
        );
        let mut bad = c.clone();
        bad[3] ^= 1;
        assert_eq!(
            CookieState::open(&bad, &key, 1500, 60_000),
            Err(CookieError::Signature)
        );
        assert_eq!(
            CookieState::open(&c[..COOKIE_LEN - 1], &key, 1500, 60_000),
            Err(CookieError::Length(COOKIE_LEN - 1))
        );
        assert_eq!(
            CookieState::open(&c[1..], &key, 1500, 60_000),
            Err(CookieError::Signature)
        );
    }
}
