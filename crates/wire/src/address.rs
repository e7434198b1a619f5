//! Where an ASAP or ENRP speaker listens or is reached, with the transport that carries the
//! messages: `tcp://192.0.2.1:3863` (the TCP mapping; the default when no scheme is given),
//! `sctp://192.0.2.1:3863` (SCTP as IP protocol 132, RFC 9260) and
//! `sctp+udp://192.0.2.1:3863` (SCTP encapsulated in UDP, RFC 6951, UDP port 9899 unless
//! `?udp=PORT` names another). The port is always the ASAP or ENRP port — the SCTP port for
//! both SCTP schemes.
//!
//! Settings that take several (a registrar listening on TCP and SCTP at once) take an
//! [`AddressList`]: a comma-separated string on the command line, a string or an array of
//! strings in a TOML file.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// The UDP port of SCTP over UDP (RFC 6951 §5.1, IANA "sctp-tunneling").
pub const SCTP_UDP_PORT: u16 = 9899;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// TCP, messages framed by their length (the TCP mapping of ASAP and ENRP).
    Tcp,
    /// SCTP as IP protocol 132.
    Sctp,
    /// SCTP over UDP; the UDP port of both ends.
    SctpUdp { udp_port: u16 },
}

impl Scheme {
    pub fn is_sctp(self) -> bool {
        !matches!(self, Self::Tcp)
    }
}

/// A transport and a socket address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Address {
    pub scheme: Scheme,
    pub addr: SocketAddr,
}

impl Address {
    pub fn tcp(addr: SocketAddr) -> Self {
        Self {
            scheme: Scheme::Tcp,
            addr,
        }
    }

    pub fn sctp_udp(addr: SocketAddr) -> Self {
        Self {
            scheme: Scheme::SctpUdp {
                udp_port: SCTP_UDP_PORT,
            },
            addr,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("unknown scheme {0:?} in {1:?} (tcp://, sctp:// or sctp+udp://; none means tcp://)")]
    Scheme(String, String),
    #[error("{0:?} is not an IP address and port (e.g. 192.0.2.1:3863 or [2001:db8::1]:3863)")]
    Addr(String),
    #[error("{0:?}: only sctp+udp:// takes an option (?udp=PORT)")]
    Option(String),
    #[error("{0:?}: bad UDP port option (write ?udp=PORT, PORT 1 to 65535)")]
    UdpPort(String),
}

impl FromStr for Address {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (scheme, rest) = match s.split_once("://") {
            Some((scheme, rest)) => (scheme, rest),
            None => ("tcp", s),
        };
        let (addr, option) = match rest.split_once('?') {
            Some((a, o)) => (a, Some(o)),
            None => (rest, None),
        };
        let addr: SocketAddr = addr.parse().map_err(|_| AddressError::Addr(s.into()))?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "tcp" => Scheme::Tcp,
            "sctp" => Scheme::Sctp,
            "sctp+udp" => Scheme::SctpUdp {
                udp_port: SCTP_UDP_PORT,
            },
            _ => return Err(AddressError::Scheme(scheme.into(), s.into())),
        };
        let scheme = match (scheme, option) {
            (scheme, None) => scheme,
            (Scheme::SctpUdp { .. }, Some(o)) => {
                let port = o
                    .strip_prefix("udp=")
                    .and_then(|p| p.parse::<u16>().ok())
                    .filter(|p| *p != 0)
                    .ok_or_else(|| AddressError::UdpPort(s.into()))?;
                Scheme::SctpUdp { udp_port: port }
            }
            _ => return Err(AddressError::Option(s.into())),
        };
        Ok(Self { scheme, addr })
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scheme {
            Scheme::Tcp => write!(f, "tcp://{}", self.addr),
            Scheme::Sctp => write!(f, "sctp://{}", self.addr),
            Scheme::SctpUdp {
                udp_port: SCTP_UDP_PORT,
            } => write!(f, "sctp+udp://{}", self.addr),
            Scheme::SctpUdp { udp_port } => write!(f, "sctp+udp://{}?udp={udp_port}", self.addr),
        }
    }
}

impl From<SocketAddr> for Address {
    fn from(addr: SocketAddr) -> Self {
        Self::tcp(addr)
    }
}

impl serde::Serialize for Address {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Address {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One address or several.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AddressList(pub Vec<Address>);

impl AddressList {
    pub fn iter(&self) -> impl Iterator<Item = &Address> {
        self.0.iter()
    }

    /// The addresses with the TCP scheme.
    pub fn tcp(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.iter()
            .filter(|a| a.scheme == Scheme::Tcp)
            .map(|a| a.addr)
    }

    /// The addresses with an SCTP scheme.
    pub fn sctp(&self) -> impl Iterator<Item = Address> + '_ {
        self.iter().filter(|a| a.scheme.is_sctp()).copied()
    }
}

impl From<Address> for AddressList {
    fn from(a: Address) -> Self {
        Self(vec![a])
    }
}

impl From<SocketAddr> for AddressList {
    fn from(a: SocketAddr) -> Self {
        Self(vec![Address::tcp(a)])
    }
}

impl FromStr for AddressList {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .filter(|p| !p.trim().is_empty())
            .map(str::parse)
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }
}

impl fmt::Display for AddressList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

impl serde::Serialize for AddressList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(s),
            all => all.serialize(s),
        }
    }
}

impl<'de> serde::Deserialize<'de> for AddressList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // By hand rather than an untagged enum, which would hide why an address is wrong.
        struct OneOrMany;
        impl<'de> serde::de::Visitor<'de> for OneOrMany {
            type Value = AddressList;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an address or a list of addresses")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<AddressList, E> {
                s.parse().map_err(E::custom)
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<AddressList, A::Error> {
                let mut all = Vec::new();
                while let Some(a) = seq.next_element::<Address>()? {
                    all.push(a);
                }
                Ok(AddressList(all))
            }
        }
        d.deserialize_any(OneOrMany)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_parse_and_print_back() {
        for (text, shown) in [
            ("127.0.0.1:3863", "tcp://127.0.0.1:3863"),
            ("tcp://127.0.0.1:3863", "tcp://127.0.0.1:3863"),
            ("sctp://[::1]:3863", "sctp://[::1]:3863"),
            ("SCTP+UDP://192.0.2.1:3863", "sctp+udp://192.0.2.1:3863"),
            (
                "sctp+udp://192.0.2.1:3863?udp=9900",
                "sctp+udp://192.0.2.1:3863?udp=9900",
            ),
        ] {
            let a: Address = text.parse().unwrap();
            assert_eq!(a.to_string(), shown);
            assert_eq!(shown.parse::<Address>().unwrap(), a);
        }
        let a: Address = "sctp+udp://192.0.2.1:3863".parse().unwrap();
        assert_eq!(a.scheme, Scheme::SctpUdp { udp_port: 9899 });
    }

    #[test]
    fn bad_addresses_say_why() {
        for (text, needle) in [
            ("udp://1.2.3.4:5", "unknown scheme"),
            ("tcp://localhost:5", "not an IP address"),
            ("tcp://1.2.3.4:5?udp=9", "only sctp+udp"),
            ("sctp+udp://1.2.3.4:5?udp=0", "bad UDP port"),
            ("sctp+udp://1.2.3.4:5?port=9", "bad UDP port"),
        ] {
            let e = text.parse::<Address>().unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn lists_from_flags_and_files() {
        let l: AddressList = "127.0.0.1:3863, sctp+udp://0.0.0.0:3863".parse().unwrap();
        assert_eq!(l.tcp().count(), 1);
        assert_eq!(l.sctp().count(), 1);
        assert_eq!(
            l.to_string(),
            "tcp://127.0.0.1:3863,sctp+udp://0.0.0.0:3863"
        );
        #[derive(serde::Deserialize)]
        struct F {
            one: AddressList,
            many: AddressList,
        }
        let f: F = toml::from_str(
            "one = \"127.0.0.1:1\"\nmany = [\"tcp://127.0.0.1:1\", \"sctp://127.0.0.1:2\"]",
        )
        .unwrap();
        assert_eq!(f.one.0.len(), 1);
        assert_eq!(f.many.0.len(), 2);
    }
}
