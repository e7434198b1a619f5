//! Compiles the eBPF datapath (`bpf/splice.c`, and the distributor's `bpf/watch.c`) with
//! clang when there is one. Without clang (or when it fails) the crate still builds: it then
//! says at run time, once, why the kernel splice is unavailable — never a build failure,
//! never a silent fallback.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=bpf/splice.c");
    println!("cargo::rerun-if-changed=bpf/watch.c");
    println!("cargo::rerun-if-env-changed=CLANG");
    println!("cargo::rustc-check-cfg=cfg(ksplice_built)");
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let mut why = None;
    for (source, object, env) in [
        ("bpf/splice.c", "splice.bpf.o", "KSPLICE_OBJECT"),
        ("bpf/watch.c", "watch.bpf.o", "KSPLICE_WATCH_OBJECT"),
    ] {
        let out = dir.join(object);
        match compile(&clang, source, &out) {
            None => println!("cargo::rustc-env={env}={}", out.display()),
            Some(w) => {
                why = Some(w);
                break;
            }
        }
    }
    match why {
        None => println!("cargo::rustc-cfg=ksplice_built"),
        Some(why) => {
            println!("cargo::warning=kernel splice unavailable: {why}");
            println!("cargo::rustc-env=KSPLICE_UNAVAILABLE={why}");
        }
    }
}

/// Compiles `source` to the eBPF object `out`; why not, if it could not.
fn compile(clang: &str, source: &str, out: &std::path::Path) -> Option<String> {
    let mut cmd = Command::new(clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // Debian keeps asm/types.h under the multiarch directory.
    for dir in [
        "/usr/include/x86_64-linux-gnu",
        "/usr/include/aarch64-linux-gnu",
    ] {
        if std::path::Path::new(dir).is_dir() {
            cmd.arg(format!("-I{dir}"));
        }
    }
    cmd.args(["-c", source, "-o"]).arg(out);
    match cmd.output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{clang} could not compile {source}: {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .find(|l| l.contains("error"))
                .unwrap_or("unknown error")
                .trim()
        )),
        Err(e) => Some(format!(
            "no {clang} to compile the datapath ({e}); install clang and libbpf-dev and rebuild"
        )),
    }
}
