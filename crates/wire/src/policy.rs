//! Pool Member Selection Policy parameter (RFC 5356 §3, plus rsplib's private policies that
//! Wireshark decodes). Every field after the policy type is a 32-bit unsigned integer.
//!
//! A policy type the codec does not know is kept as [`Policy::Other`] with its raw data, so a
//! registrar can still refuse it with a precise error and private-range policies of our own can be
//! added later without touching the decoder.

use crate::error::{DecodeError, DecodeErrorKind};
use crate::ptype;
use crate::tlv::{Encoder, RawTlv};

/// Policy type codes.
pub mod policy_type {
    pub const ROUND_ROBIN: u32 = 0x0000_0001;
    pub const WEIGHTED_ROUND_ROBIN: u32 = 0x0000_0002;
    pub const RANDOM: u32 = 0x0000_0003;
    pub const WEIGHTED_RANDOM: u32 = 0x0000_0004;
    pub const PRIORITY: u32 = 0x0000_0005;
    pub const LEAST_USED: u32 = 0x4000_0001;
    pub const LEAST_USED_DEGRADATION: u32 = 0x4000_0002;
    pub const PRIORITY_LEAST_USED: u32 = 0x4000_0003;
    pub const RANDOMIZED_LEAST_USED: u32 = 0x4000_0004;
    // rsplib's private policies (draft-dreibholz-rserpool-policies, Wireshark's names).
    pub const RANDOMIZED_PRIORITY_LEAST_USED: u32 = 0xb000_1001;
    pub const RANDOMIZED_LEAST_USED_DEGRADATION: u32 = 0xb000_1002;
    pub const PRIORITY_LEAST_USED_DEGRADATION: u32 = 0xb000_1003;
    pub const RANDOMIZED_PRIORITY_LEAST_USED_DEGRADATION: u32 = 0xb000_1004;
    pub const WEIGHTED_RANDOM_DPF: u32 = 0xb000_2001;
    pub const LEAST_USED_DPF: u32 = 0xb000_2002;
    pub const LEAST_USED_DEGRADATION_DPF: u32 = 0xb000_2003;
    /// rserpool's credits (private and adaptive): the connections a PE can take now, and its
    /// capacity (docs/CREDITS.md).
    pub const CREDITS: u32 = 0xc5a1_0001;

    /// The adaptive bit: the policy uses load information reported by the PEs.
    pub const ADAPTIVE: u32 = 0x4000_0000;
    /// The private bit: not an IETF-defined policy.
    pub const PRIVATE: u32 = 0x8000_0000;
}

use policy_type as pt;

/// A pool member selection policy with its per-PE parameters.
///
/// Load and load degradation use the RFC's scale: 0 = 0%, `u32::MAX` = 100%.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Policy {
    RoundRobin,
    WeightedRoundRobin {
        weight: u32,
    },
    Random,
    WeightedRandom {
        weight: u32,
    },
    Priority {
        priority: u32,
    },
    LeastUsed {
        load: u32,
    },
    LeastUsedDegradation {
        load: u32,
        degradation: u32,
    },
    PriorityLeastUsed {
        load: u32,
        degradation: u32,
    },
    RandomizedLeastUsed {
        load: u32,
    },
    RandomizedPriorityLeastUsed {
        load: u32,
        degradation: u32,
    },
    RandomizedLeastUsedDegradation {
        load: u32,
        degradation: u32,
    },
    PriorityLeastUsedDegradation {
        load: u32,
        degradation: u32,
    },
    RandomizedPriorityLeastUsedDegradation {
        load: u32,
        degradation: u32,
    },
    WeightedRandomDpf {
        weight: u32,
        weight_dpf: u32,
        distance: u32,
    },
    LeastUsedDpf {
        load: u32,
        load_dpf: u32,
        distance: u32,
    },
    LeastUsedDegradationDpf {
        load: u32,
        degradation: u32,
        load_dpf: u32,
        distance: u32,
    },
    /// rserpool's credit-based policy (salbnet's DPR and DPR-Q, docs/CREDITS.md): the PE
    /// pushes how many more connections or requests it can take now; most credits first.
    Credits {
        credits: u32,
        capacity: u32,
    },
    /// A policy type this codec does not know, with its raw data (boxed: it is rare, and
    /// every PE entry in a handlespace pays for the largest variant).
    Other {
        policy_type: u32,
        data: Box<[u8]>,
    },
}

/// The pattern of every policy that carries a load, binding it to `$load`: the one list of them.
macro_rules! with_load_field {
    ($load:ident) => {
        Policy::LeastUsed { load: $load }
            | Policy::RandomizedLeastUsed { load: $load }
            | Policy::LeastUsedDegradation { load: $load, .. }
            | Policy::PriorityLeastUsed { load: $load, .. }
            | Policy::RandomizedPriorityLeastUsed { load: $load, .. }
            | Policy::RandomizedLeastUsedDegradation { load: $load, .. }
            | Policy::PriorityLeastUsedDegradation { load: $load, .. }
            | Policy::RandomizedPriorityLeastUsedDegradation { load: $load, .. }
            | Policy::LeastUsedDpf { load: $load, .. }
            | Policy::LeastUsedDegradationDpf { load: $load, .. }
    };
}

impl Policy {
    pub fn policy_type(&self) -> u32 {
        match self {
            Self::RoundRobin => pt::ROUND_ROBIN,
            Self::WeightedRoundRobin { .. } => pt::WEIGHTED_ROUND_ROBIN,
            Self::Random => pt::RANDOM,
            Self::WeightedRandom { .. } => pt::WEIGHTED_RANDOM,
            Self::Priority { .. } => pt::PRIORITY,
            Self::LeastUsed { .. } => pt::LEAST_USED,
            Self::LeastUsedDegradation { .. } => pt::LEAST_USED_DEGRADATION,
            Self::PriorityLeastUsed { .. } => pt::PRIORITY_LEAST_USED,
            Self::RandomizedLeastUsed { .. } => pt::RANDOMIZED_LEAST_USED,
            Self::RandomizedPriorityLeastUsed { .. } => pt::RANDOMIZED_PRIORITY_LEAST_USED,
            Self::RandomizedLeastUsedDegradation { .. } => pt::RANDOMIZED_LEAST_USED_DEGRADATION,
            Self::PriorityLeastUsedDegradation { .. } => pt::PRIORITY_LEAST_USED_DEGRADATION,
            Self::RandomizedPriorityLeastUsedDegradation { .. } => {
                pt::RANDOMIZED_PRIORITY_LEAST_USED_DEGRADATION
            }
            Self::WeightedRandomDpf { .. } => pt::WEIGHTED_RANDOM_DPF,
            Self::LeastUsedDpf { .. } => pt::LEAST_USED_DPF,
            Self::LeastUsedDegradationDpf { .. } => pt::LEAST_USED_DEGRADATION_DPF,
            Self::Credits { .. } => pt::CREDITS,
            Self::Other { policy_type, .. } => *policy_type,
        }
    }

    /// The policy's per-PE fields in wire order (empty for [`Policy::Other`]).
    fn fields(&self) -> ([u32; 4], usize) {
        match *self {
            Self::RoundRobin | Self::Random | Self::Other { .. } => ([0; 4], 0),
            Self::WeightedRoundRobin { weight } | Self::WeightedRandom { weight } => {
                ([weight, 0, 0, 0], 1)
            }
            Self::Priority { priority } => ([priority, 0, 0, 0], 1),
            Self::LeastUsed { load } | Self::RandomizedLeastUsed { load } => ([load, 0, 0, 0], 1),
            Self::LeastUsedDegradation { load, degradation }
            | Self::PriorityLeastUsed { load, degradation }
            | Self::RandomizedPriorityLeastUsed { load, degradation }
            | Self::RandomizedLeastUsedDegradation { load, degradation }
            | Self::PriorityLeastUsedDegradation { load, degradation }
            | Self::RandomizedPriorityLeastUsedDegradation { load, degradation } => {
                ([load, degradation, 0, 0], 2)
            }
            Self::WeightedRandomDpf {
                weight,
                weight_dpf,
                distance,
            } => ([weight, weight_dpf, distance, 0], 3),
            Self::LeastUsedDpf {
                load,
                load_dpf,
                distance,
            } => ([load, load_dpf, distance, 0], 3),
            Self::LeastUsedDegradationDpf {
                load,
                degradation,
                load_dpf,
                distance,
            } => ([load, degradation, load_dpf, distance], 4),
            Self::Credits { credits, capacity } => ([credits, capacity, 0, 0], 2),
        }
    }

    /// True for policies whose selection depends on reported load (the A bit).
    pub fn is_adaptive(&self) -> bool {
        self.policy_type() & pt::ADAPTIVE != 0
    }

    /// The load carried by an adaptive policy, if any.
    pub fn load(&self) -> Option<u32> {
        match *self {
            with_load_field!(load) => Some(load),
            _ => None,
        }
    }

    /// The policy named by its [`short_name`](Self::short_name) (RFC 5356 policies and
    /// `credits`), with `value` as its weight, priority or capacity, zero load and full credit.
    pub fn from_name(name: &str, value: u32) -> Option<Self> {
        Some(match name {
            "rr" => Self::RoundRobin,
            "wrr" => Self::WeightedRoundRobin { weight: value },
            "rand" => Self::Random,
            "wrand" => Self::WeightedRandom { weight: value },
            "prio" => Self::Priority { priority: value },
            "lu" => Self::LeastUsed { load: 0 },
            "lud" => Self::LeastUsedDegradation {
                load: 0,
                degradation: 0,
            },
            "plu" => Self::PriorityLeastUsed {
                load: 0,
                degradation: 0,
            },
            "rlu" => Self::RandomizedLeastUsed { load: 0 },
            "credits" => Self::Credits {
                credits: value,
                capacity: value,
            },
            _ => return None,
        })
    }

    /// The same policy carrying another load (no change for non-adaptive policies).
    pub fn with_load(&self, new_load: u32) -> Self {
        let mut p = self.clone();
        match &mut p {
            with_load_field!(load) => *load = new_load,
            _ => {}
        }
        p
    }

    /// Short name as used on the command line and in logs.
    pub fn short_name(&self) -> &'static str {
        match self {
            Self::RoundRobin => "rr",
            Self::WeightedRoundRobin { .. } => "wrr",
            Self::Random => "rand",
            Self::WeightedRandom { .. } => "wrand",
            Self::Priority { .. } => "prio",
            Self::LeastUsed { .. } => "lu",
            Self::LeastUsedDegradation { .. } => "lud",
            Self::PriorityLeastUsed { .. } => "plu",
            Self::RandomizedLeastUsed { .. } => "rlu",
            Self::RandomizedPriorityLeastUsed { .. } => "rplu",
            Self::RandomizedLeastUsedDegradation { .. } => "rlud",
            Self::PriorityLeastUsedDegradation { .. } => "plud",
            Self::RandomizedPriorityLeastUsedDegradation { .. } => "rplud",
            Self::WeightedRandomDpf { .. } => "wrand-dpf",
            Self::LeastUsedDpf { .. } => "lu-dpf",
            Self::LeastUsedDegradationDpf { .. } => "lud-dpf",
            Self::Credits { .. } => "credits",
            Self::Other { .. } => "other",
        }
    }

    pub(crate) fn encode(&self, e: &mut Encoder<'_>) {
        let s = e.begin(ptype::POLICY);
        e.u32(self.policy_type());
        if let Self::Other { data, .. } = self {
            e.raw(data);
        } else {
            let (f, n) = self.fields();
            f[..n].iter().for_each(|&v| e.u32(v));
        }
        e.end(s);
    }

    pub(crate) fn decode(tlv: &RawTlv<'_>) -> Result<Self, DecodeError> {
        let invalid = || DecodeError::invalid(DecodeErrorKind::InvalidValue("policy"), tlv.whole);
        let v = tlv.value;
        let word = |i: usize| -> Result<u32, DecodeError> {
            v.get(i * 4..i * 4 + 4)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                .ok_or_else(invalid)
        };
        let ty = word(0)?;
        // Fields beyond what a policy defines are ignored (liberal in what we accept).
        Ok(match ty {
            pt::ROUND_ROBIN => Self::RoundRobin,
            pt::WEIGHTED_ROUND_ROBIN => Self::WeightedRoundRobin { weight: word(1)? },
            pt::RANDOM => Self::Random,
            pt::WEIGHTED_RANDOM => Self::WeightedRandom { weight: word(1)? },
            pt::PRIORITY => Self::Priority { priority: word(1)? },
            pt::LEAST_USED => Self::LeastUsed { load: word(1)? },
            pt::LEAST_USED_DEGRADATION => Self::LeastUsedDegradation {
                load: word(1)?,
                degradation: word(2)?,
            },
            // rsplib sends Priority-LU without the degradation field (length 0xC).
            pt::PRIORITY_LEAST_USED => Self::PriorityLeastUsed {
                load: word(1)?,
                degradation: word(2).unwrap_or(0),
            },
            pt::RANDOMIZED_LEAST_USED => Self::RandomizedLeastUsed { load: word(1)? },
            pt::RANDOMIZED_PRIORITY_LEAST_USED => Self::RandomizedPriorityLeastUsed {
                load: word(1)?,
                degradation: word(2)?,
            },
            pt::RANDOMIZED_LEAST_USED_DEGRADATION => Self::RandomizedLeastUsedDegradation {
                load: word(1)?,
                degradation: word(2)?,
            },
            pt::PRIORITY_LEAST_USED_DEGRADATION => Self::PriorityLeastUsedDegradation {
                load: word(1)?,
                degradation: word(2)?,
            },
            pt::RANDOMIZED_PRIORITY_LEAST_USED_DEGRADATION => {
                Self::RandomizedPriorityLeastUsedDegradation {
                    load: word(1)?,
                    degradation: word(2)?,
                }
            }
            pt::WEIGHTED_RANDOM_DPF => Self::WeightedRandomDpf {
                weight: word(1)?,
                weight_dpf: word(2)?,
                distance: word(3)?,
            },
            pt::LEAST_USED_DPF => Self::LeastUsedDpf {
                load: word(1)?,
                load_dpf: word(2)?,
                distance: word(3)?,
            },
            pt::LEAST_USED_DEGRADATION_DPF => Self::LeastUsedDegradationDpf {
                load: word(1)?,
                degradation: word(2)?,
                load_dpf: word(3)?,
                distance: word(4)?,
            },
            pt::CREDITS => Self::Credits {
                credits: word(1)?,
                capacity: word(2)?,
            },
            0 | pt::ADAPTIVE => return Err(invalid()),
            other => Self::Other {
                policy_type: other,
                data: v[4..].into(),
            },
        })
    }
}

/// Converts a utilisation fraction (0.0..=1.0) to the RFC's load scale.
pub fn load_from_fraction(f: f64) -> u32 {
    (f.clamp(0.0, 1.0) * f64::from(u32::MAX)).round() as u32
}

/// Converts the RFC's load scale to a fraction 0.0..=1.0.
pub fn load_to_fraction(load: u32) -> f64 {
    f64::from(load) / f64::from(u32::MAX)
}

/// `name` plus the policy's fields, loads as percentages: `lu load=25.0%`, `wrr weight=3`.
impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.short_name())?;
        let pct = |v: u32| load_to_fraction(v) * 100.0;
        match *self {
            Self::RoundRobin | Self::Random => Ok(()),
            Self::WeightedRoundRobin { weight } | Self::WeightedRandom { weight } => {
                write!(f, " weight={weight}")
            }
            Self::Priority { priority } => write!(f, " priority={priority}"),
            Self::Other { policy_type, .. } => write!(f, " type={policy_type:#010x}"),
            Self::Credits { credits, capacity } => write!(f, " credits={credits}/{capacity}"),
            _ => {
                write!(f, " load={:.1}%", pct(self.load().unwrap_or(0)))?;
                let (fields, n) = self.fields();
                if n >= 2
                    && !matches!(
                        self,
                        Self::WeightedRandomDpf { .. } | Self::LeastUsedDpf { .. }
                    )
                {
                    write!(f, " degradation={:.1}%", pct(fields[1]))?;
                }
                Ok(())
            }
        }
    }
}
