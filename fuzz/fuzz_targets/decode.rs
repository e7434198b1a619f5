//! Feeds arbitrary bytes to both decoders and the stream framer; the property is
//! `rserpool_wire::fuzzing::decode`, which `cargo test` also runs on the seeds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rserpool_wire::fuzzing::decode(data));
