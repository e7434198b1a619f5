//! Feeds arbitrary bytes to the proxy's chunked body scanner; the property is
//! `rserpool_proxy::fuzzing::chunked`, which `cargo test` also runs on the seeds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rserpool_proxy::fuzzing::chunked(data));
