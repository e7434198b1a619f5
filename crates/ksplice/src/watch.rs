//! The distributor's traffic watch (docs/TIER.md, "Finding a dead proxy").
//!
//! Why: heartbeats find a proxy that died silently (its link up) only after 2–3 intervals,
//! and by then the TCP senders whose packets went to it have lost a retransmission and
//! doubled their timeout. The router sees sooner: a proxy that carries traffic sends frames
//! back all the time, so one that keeps being sent frames and sends none for a few tens of
//! milliseconds is dead. TC programs on the router's interface towards the proxies
//! (`bpf/watch.c`) count the frames per proxy MAC address; the distributor reads the
//! counters. An idle proxy is never found this way (nothing to lose): its heartbeats are.

use crate::Error;
use std::collections::HashMap;

/// The most MAC addresses a watch counts.
pub const WATCH_MAX: usize = crate::abi::WATCH_MAX as usize;

#[cfg(ksplice_built)]
static WATCH_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("KSPLICE_WATCH_OBJECT"));

/// Frames counted for one MAC address since it was added (`struct traffic` of `bpf/abi.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// From the proxy to the router.
    pub from: u64,
    /// From the router to the proxy.
    pub to: u64,
}

#[cfg(ksplice_built)]
#[allow(unsafe_code)]
// SAFETY: plain `repr(C)` u64s, as the program writes them.
unsafe impl aya::Pod for Traffic {}

#[cfg_attr(not(ksplice_built), allow(dead_code))]
fn key(mac: [u8; 6]) -> u64 {
    let mut k = [0u8; 8];
    k[..6].copy_from_slice(&mac);
    u64::from_ne_bytes(k)
}

/// The programs, attached at TC ingress and egress of one interface for as long as the value
/// lives.
pub struct Watch {
    #[cfg(ksplice_built)]
    ebpf: aya::Ebpf,
}

impl Watch {
    /// Attaches to `interface` (in the calling thread's network namespace). Needs root.
    pub fn attach(interface: &str) -> Result<Self, Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = interface;
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            use aya::programs::{SchedClassifier, TcAttachType, tc};
            let e = |what: &str, err: &dyn std::fmt::Display| Error::Ebpf(format!("{what}: {err}"));
            crate::ifindex(interface)?;
            let mut ebpf = aya::Ebpf::load(WATCH_OBJECT).map_err(|err| e("loading", &err))?;
            let _ = tc::qdisc_add_clsact(interface);
            for (name, at) in [
                ("watch_in", TcAttachType::Ingress),
                ("watch_out", TcAttachType::Egress),
            ] {
                let prog: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .ok_or_else(|| Error::Ebpf(format!("no program {name}")))?
                    .try_into()
                    .map_err(|err| e("program type", &err))?;
                prog.load()
                    .map_err(|err| e("the verifier refused it", &err))?;
                prog.attach(interface, at)
                    .map_err(|err| e(&format!("attaching to {interface}"), &err))?;
            }
            Ok(Self { ebpf })
        }
    }

    /// Counts the frames of exactly these MAC addresses (a new one from zero; at most
    /// [`WATCH_MAX`]).
    pub fn set(&mut self, macs: &[[u8; 6]]) -> Result<(), Error> {
        if macs.len() > WATCH_MAX {
            return Err(Error::Ebpf(format!(
                "more than {WATCH_MAX} MAC addresses to watch"
            )));
        }
        #[cfg(not(ksplice_built))]
        {
            let _ = macs;
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let mut map = self.map()?;
            let want: Vec<u64> = macs.iter().map(|m| key(*m)).collect();
            let have: Vec<u64> = map.keys().filter_map(Result::ok).collect();
            for k in have.iter().filter(|k| !want.contains(k)) {
                let _ = map.remove(k);
            }
            for k in want.iter().filter(|k| !have.contains(k)) {
                map.insert(*k, Traffic::default(), 0)
                    .map_err(|err| Error::Ebpf(format!("watch map: {err}")))?;
            }
            Ok(())
        }
    }

    /// The counts of every watched MAC address.
    pub fn read(&mut self) -> Result<HashMap<[u8; 6], Traffic>, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let map = self.map()?;
            Ok(map
                .iter()
                .filter_map(Result::ok)
                .map(|(k, t)| {
                    let b = k.to_ne_bytes();
                    ([b[0], b[1], b[2], b[3], b[4], b[5]], t)
                })
                .collect())
        }
    }

    #[cfg(ksplice_built)]
    fn map(&mut self) -> Result<aya::maps::HashMap<&mut aya::maps::MapData, u64, Traffic>, Error> {
        let map = self
            .ebpf
            .map_mut(crate::abi::WATCH_MAP)
            .ok_or_else(|| Error::Ebpf(format!("no map {}", crate::abi::WATCH_MAP)))?;
        aya::maps::HashMap::try_from(map).map_err(|err| Error::Ebpf(format!("watch map: {err}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_is_its_six_bytes_in_memory_order() {
        let k = key([1, 2, 3, 4, 5, 6]);
        assert_eq!(&k.to_ne_bytes()[..6], &[1, 2, 3, 4, 5, 6]);
        assert_eq!(&k.to_ne_bytes()[6..], &[0, 0]);
    }
}
