//! Feeds arbitrary bytes to the proxy as a request head from a client and a response head
//! from a PE; the property is `rserpool_proxy::fuzzing::http_head`, which `cargo test` also
//! runs on the seeds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rserpool_proxy::fuzzing::http_head(data));
