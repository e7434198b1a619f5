//! The chaos soak's one-minute run (docs/RELIABILITY.md): `rserpool-bench chaos --duration-s 60` with the
//! `rserpool` built beside it. It needs root for its network namespaces, and iproute2 and
//! nftables (`.ci/run` installs them); without root it is skipped, except under `CI`, where
//! that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

#[test]
fn a_minute_of_chaos_loses_no_pe_and_fails_no_request() {
    if !rustix::process::geteuid().is_root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "the chaos soak needs root (network namespaces)"
        );
        eprintln!("SKIPPED: the chaos soak needs root (network namespaces)");
        return;
    }
    let bench = env!("CARGO_BIN_EXE_rserpool-bench");
    // Cargo builds it for the rserpool crate's own tests; `cargo test --workspace` does both.
    let rserpool = Path::new(bench).with_file_name("rserpool");
    assert!(
        rserpool.is_file(),
        "{} is missing: run `cargo test --workspace`, or build rserpool first",
        rserpool.display()
    );
    let out = Command::new(bench)
        .arg("--rserpool")
        .arg(&rserpool)
        // The tier's host deaths are left to the long runs (see `--tier-deaths`).
        .args(["chaos", "--duration-s", "60", "--tier-deaths", "false"])
        .output()
        .expect("run rserpool-bench chaos");
    // Shown when the test fails: the faults as they came, the summary and the findings.
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the chaos soak failed: {}",
        out.status
    );
}
