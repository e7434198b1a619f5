//! Registration Life over SCTP. RFC 5354 §3.3.5 counts a PE's Registration Life in seconds;
//! rsplib, the implementation that speaks ASAP and ENRP over SCTP, counts it in milliseconds
//! (its PEs send 90,000 for the same 90 s). rserpool keeps seconds everywhere and converts at
//! the SCTP boundary: what goes out over an SCTP association is in milliseconds, what comes in
//! over one is read as milliseconds. Over TCP (rserpool's own mapping) seconds stay. Without
//! this, rsplib's registrar expires rserpool's PEs from a peer's handle table at once (90 ms),
//! and reads rsplib's PEs as living 25 hours.

use crate::enrp::{EnrpBody, EnrpMessage};
use crate::param::PoolElement;

/// Seconds (as kept) to milliseconds (as sent over SCTP); infinite (any value below 1) stays.
pub fn to_sctp(seconds: i32) -> i32 {
    if seconds < 1 {
        seconds
    } else {
        seconds.saturating_mul(1000)
    }
}

/// Milliseconds (as received over SCTP) to seconds, rounded up; infinite stays.
pub fn from_sctp(ms: i32) -> i32 {
    if ms < 1 {
        ms
    } else {
        ms / 1000 + i32::from(ms % 1000 != 0)
    }
}

/// Converts the Registration Life of every PE in `msg` with `f`.
pub fn convert_enrp(msg: &mut EnrpMessage, f: fn(i32) -> i32) {
    let each = |pe: &mut PoolElement| pe.registration_life = f(pe.registration_life);
    match &mut msg.body {
        EnrpBody::HandleUpdate { pool_element, .. } => each(pool_element),
        EnrpBody::HandleTableResponse { pools, .. } => pools
            .iter_mut()
            .flat_map(|p| p.pool_elements.iter_mut())
            .for_each(each),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_and_milliseconds_round_trip_and_infinite_stays() {
        assert_eq!(to_sctp(90), 90_000);
        assert_eq!(from_sctp(90_000), 90);
        assert_eq!(from_sctp(1), 1, "a millisecond is not zero (infinite)");
        assert_eq!(from_sctp(1_500), 2);
        for infinite in [-1, 0] {
            assert_eq!(to_sctp(infinite), infinite);
            assert_eq!(from_sctp(infinite), infinite);
        }
        assert_eq!(to_sctp(i32::MAX), i32::MAX);
    }
}
