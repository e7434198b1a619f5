//! What the datapath and this crate share, from `bpf/abi.h`: the maps' names and sizes and the
//! entry flags as constants, and compile-time assertions that the Rust mirrors of the
//! header's structs (`FlowKey`, `FlowVal`, `RawCounters`, `RawTierMember`, `Traffic`) have
//! their C layout, field by field. `build.rs` generates both with the host's C compiler: a
//! struct changed on one side only fails the build instead of corrupting the maps.

// Not every build uses every constant: without clang no map is ever opened.
#![cfg_attr(not(ksplice_built), allow(dead_code))]

include!(concat!(env!("OUT_DIR"), "/abi.rs"));

/// The size of the field `get` reads (the assertions' way to name a field's type).
pub(crate) const fn field_size<T, F>(_get: fn(&T) -> &F) -> usize {
    core::mem::size_of::<F>()
}
