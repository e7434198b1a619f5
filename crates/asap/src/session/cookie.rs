//! Session cookies: the state a pool element hands its pool user in ASAP COOKIEs, and takes
//! back from a COOKIE_ECHO after a failover (RFC 5351 §2, RFC 5352 §2.2.11–12).
//!
//! The pool user keeps the cookie without reading it. A PE must not trust what comes back,
//! though: RFC 5355 §3 names a PU that forges state. So with a pool secret configured (every PE
//! of the pool shares it) a cookie is sealed with HMAC-SHA256 over the pool handle, the time it
//! was issued and the state; a PE with the secret refuses a cookie whose tag does not match,
//! one sealed for another pool, one older than a maximum age, and an unsealed one. Several
//! secrets may be given to rotate them: the first seals, any opens. The state is not encrypted
//! (the PU may read it); encrypt it inside if that matters.
//!
//! Layout (docs/SESSION.md): kind (1 byte: 0 unsealed, 1 HMAC-SHA256), issued (8 bytes,
//! milliseconds since the UNIX epoch), the state, and for kind 1 the 32-byte tag.

use bytes::{BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use rserpool_wire::PoolHandle;
use sha2::Sha256;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const UNSEALED: u8 = 0;
const HMAC_SHA256: u8 = 1;
const HEAD: usize = 9;
const TAG: usize = 32;
/// Bound into every tag, so a tag made for anything else never opens a cookie.
const CONTEXT: &[u8] = b"rserpool session cookie v1";

/// Why a cookie was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CookieError {
    #[error("malformed cookie")]
    Malformed,
    #[error("cookie not sealed, but this pool element requires sealed cookies")]
    Unsealed,
    #[error("sealed cookie, but this pool element has no pool secret to check it")]
    NoSecret,
    #[error("cookie tag does not match (forged, altered, or sealed for another pool)")]
    BadTag,
    #[error("cookie expired ({age_ms} ms old, at most {max_ms} ms accepted)")]
    Expired { age_ms: u64, max_ms: u64 },
}

/// Seals and opens the cookies of one pool.
#[derive(Clone)]
pub struct CookieSealer {
    pool: PoolHandle,
    secrets: Vec<Vec<u8>>,
    max_age: Option<Duration>,
}

impl std::fmt::Debug for CookieSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CookieSealer")
            .field("pool", &self.pool)
            .field("secrets", &self.secrets.len())
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl CookieSealer {
    /// Cookies of `pool`, sealed with the first of `secrets` and opened with any of them;
    /// none: unsealed cookies (only for trusted pool users).
    pub fn new(pool: PoolHandle, secrets: Vec<Vec<u8>>) -> Self {
        Self {
            pool,
            secrets: secrets.into_iter().filter(|s| !s.is_empty()).collect(),
            max_age: None,
        }
    }

    /// Refuses cookies older than `max_age` (default: any age).
    pub fn with_max_age(mut self, max_age: Option<Duration>) -> Self {
        self.max_age = max_age;
        self
    }

    pub fn sealed(&self) -> bool {
        !self.secrets.is_empty()
    }

    /// The cookie for `state`.
    pub fn seal(&self, state: &[u8]) -> Bytes {
        let issued = now_ms();
        let mut out = BytesMut::with_capacity(HEAD + state.len() + TAG);
        out.put_u8(if self.sealed() { HMAC_SHA256 } else { UNSEALED });
        out.put_u64(issued);
        out.put_slice(state);
        if let Some(secret) = self.secrets.first() {
            let tag = self.mac(secret, &out).finalize().into_bytes();
            out.put_slice(&tag);
        }
        out.freeze()
    }

    /// The state in `cookie`, if it is genuine.
    pub fn open(&self, cookie: &Bytes) -> Result<Bytes, CookieError> {
        let (&kind, rest) = cookie.split_first().ok_or(CookieError::Malformed)?;
        let issued = rest
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes)
            .ok_or(CookieError::Malformed)?;
        let state = match kind {
            UNSEALED if self.sealed() => return Err(CookieError::Unsealed),
            UNSEALED => cookie.slice(HEAD..),
            HMAC_SHA256 if !self.sealed() => return Err(CookieError::NoSecret),
            HMAC_SHA256 => {
                let end = cookie
                    .len()
                    .checked_sub(TAG)
                    .filter(|&e| e >= HEAD)
                    .ok_or(CookieError::Malformed)?;
                let (body, tag) = cookie.split_at(end);
                let genuine = self
                    .secrets
                    .iter()
                    .any(|s| self.mac(s, body).verify_slice(tag).is_ok());
                if !genuine {
                    return Err(CookieError::BadTag);
                }
                cookie.slice(HEAD..end)
            }
            _ => return Err(CookieError::Malformed),
        };
        if let Some(max) = self.max_age {
            let age_ms = now_ms().saturating_sub(issued);
            let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX);
            if age_ms > max_ms {
                return Err(CookieError::Expired { age_ms, max_ms });
            }
        }
        Ok(state)
    }

    fn mac(&self, secret: &[u8], body: &[u8]) -> Hmac<Sha256> {
        // HMAC takes keys of any length.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        m.update(CONTEXT);
        let handle = self.pool.as_bytes();
        m.update(&(handle.len() as u32).to_be_bytes());
        m.update(handle);
        m.update(body);
        m
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealer(pool: &str, secrets: &[&str]) -> CookieSealer {
        CookieSealer::new(
            PoolHandle::from(pool),
            secrets.iter().map(|s| s.as_bytes().to_vec()).collect(),
        )
    }

    #[test]
    fn a_sealed_cookie_opens_only_with_the_pools_secret() {
        let a = sealer("CalcPool", &["s3cret"]);
        let c = a.seal(b"job 7 at 1200");
        assert_eq!(c.len(), HEAD + 13 + TAG);
        assert_eq!(a.open(&c).unwrap(), &b"job 7 at 1200"[..]);
        assert_eq!(
            sealer("CalcPool", &["other"]).open(&c),
            Err(CookieError::BadTag)
        );
        assert_eq!(
            sealer("OtherPool", &["s3cret"]).open(&c),
            Err(CookieError::BadTag)
        );
        assert_eq!(sealer("CalcPool", &[]).open(&c), Err(CookieError::NoSecret));
        // Rotation: the new secret seals, the old one still opens.
        assert!(sealer("CalcPool", &["new", "s3cret"]).open(&c).is_ok());
    }

    #[test]
    fn altered_truncated_or_unsealed_cookies_are_refused() {
        let a = sealer("CalcPool", &["s3cret"]);
        let c = a.seal(b"job 7 at 1200");
        for i in 0..c.len() {
            let mut bad = c.to_vec();
            bad[i] ^= 0x40;
            assert!(a.open(&Bytes::from(bad)).is_err(), "byte {i} flipped");
        }
        for n in 0..c.len() {
            assert!(a.open(&c.slice(..n)).is_err(), "cut to {n}");
        }
        let plain = sealer("CalcPool", &[]).seal(b"job 7 at 9999");
        assert_eq!(a.open(&plain), Err(CookieError::Unsealed));
        assert_eq!(
            sealer("CalcPool", &[]).open(&plain).unwrap(),
            &b"job 7 at 9999"[..]
        );
    }

    #[test]
    fn an_old_cookie_expires() {
        let a = sealer("CalcPool", &["s3cret"]);
        let mut body = BytesMut::new();
        body.put_u8(HMAC_SHA256);
        body.put_u64(now_ms() - 60_000);
        body.put_slice(b"old");
        let tag = a.mac(b"s3cret", &body).finalize().into_bytes();
        body.put_slice(&tag);
        let c = body.freeze();
        assert!(a.open(&c).is_ok());
        let strict = a.with_max_age(Some(Duration::from_secs(10)));
        assert!(matches!(strict.open(&c), Err(CookieError::Expired { .. })));
    }
}
