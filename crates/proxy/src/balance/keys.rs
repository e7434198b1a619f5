//! The keys of consistent hashing: a request's source address, header, cookie or path as a
//! fixed 64-bit hash. The hashes are fixed functions, not seeded per process, so every proxy
//! of a tier sends the same key to the same PE.

/// splitmix64: a fixed, well-mixed hash of a 64-bit value.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a over bytes, then mixed: the key of a request's source, header, cookie or path.
pub(crate) fn key_of(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

/// The key of a client's address (IPv4 as itself, also when it came mapped into IPv6).
pub(crate) fn key_of_source(ip: std::net::IpAddr) -> u64 {
    match ip.to_canonical() {
        std::net::IpAddr::V4(a) => key_of(&a.octets()),
        std::net::IpAddr::V6(a) => key_of(&a.octets()),
    }
}
