//! `rserpool-bench registrar --against-rsplib DIR`: rserpool's registrar and rsplib's
//! (`rspregistrar`, built on its user-space SCTP stack for SCTP over UDP) under the same load,
//! side by side in one run: the load generator's PEs re-register over SCTP in UDP, from a
//! network namespace of their own (rsplib's stack sends from and to UDP port 9899 only, and
//! reads every UDP packet of its namespace), at a registrar in another. The figure compared is
//! registrations answered per CPU second of the registrar.

use super::{Measured, RegistrarBenchArgs, run_generator};
use crate::chaos::netns::Net;
use crate::process::Reaper;
use crate::report::{machine, provenance, write_section};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// One registrar's figures at one point.
struct Run {
    pes: usize,
    rereg_ms: u64,
    cpu: f64,
    answered_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    errors: u64,
}

impl Run {
    fn per_cpu_second(&self) -> f64 {
        self.answered_per_s / self.cpu.max(1e-9)
    }
}

pub(super) fn run(args: &RegistrarBenchArgs, rserpool: &Path, rsplib: &Path) -> Result<()> {
    let rspregistrar = rsplib.join("rspregistrar");
    if !rspregistrar.exists() {
        bail!(
            "no rspregistrar in {} (build rsplib for SCTP over UDP with the interoperability \
             script)",
            rsplib.display()
        );
    }
    crate::chaos::netns::preflight()?;
    let net = Net::create(&["reg", "gen"])?;
    let (reg_ip, gen_ip) = (net.hosts[0].ip, net.hosts[1].ip);
    let exe = std::env::current_exe()?;
    let pes = if args.pes.is_empty() {
        vec![1000]
    } else {
        args.pes.clone()
    };
    println!("machine: {}", machine());
    let mut rows = Vec::new();
    for &n in &pes {
        for &rereg_ms in &args.rereg_ms {
            let mut pair = Vec::new();
            for ours in [true, false] {
                let mut runs = Vec::new();
                for _ in 0..args.repeat {
                    let mut reaper = Reaper::default();
                    let mut reg = if ours {
                        let mut c = net.command(0, rserpool);
                        c.args(["registrar", "--status", "off", "--max-hr-rate", "0"])
                            .args([
                                "--asap",
                                &format!("tcp://{reg_ip}:3863,sctp+udp://{reg_ip}:3863"),
                            ])
                            .args(["--enrp", &format!("{reg_ip}:9901")])
                            .args(["--max-pes-per-pool", "200000"]);
                        c
                    } else {
                        let mut c = net.command(0, &rspregistrar);
                        c.arg(format!("-asap={reg_ip}:3863"))
                            .arg(format!("-enrp={reg_ip}:9901"))
                            .args(["-disable-ipv6", "-asapannounce=off", "-enrpannounce=off"])
                            .args(["-loglevel=0", "-logquiet"]);
                        c
                    };
                    let child = reg
                        .env("RUST_LOG", "error")
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .context("starting the registrar")?;
                    let pid = child.id();
                    reaper.0.push(child);
                    // The generator's INITs are retransmitted until the registrar answers.
                    std::thread::sleep(Duration::from_millis(500));
                    let mut generator = net.command(1, &exe);
                    generator
                        .arg("load-gen")
                        .args(["--registrar", &format!("sctp+udp://{reg_ip}:3863")])
                        .args(["--user-ip", &gen_ip.to_string()])
                        .args(["--pes", &n.to_string(), "--rereg-ms", &rereg_ms.to_string()])
                        .args(["--pus", "0", "--resolve-ms", "1000"]);
                    let Measured { cpu, result, .. } =
                        run_generator(generator, args, &mut reaper, pid, None)?;
                    runs.push(Run {
                        pes: n,
                        rereg_ms,
                        cpu,
                        answered_per_s: result.answered as f64 / result.seconds,
                        p50_us: result.p50_us,
                        p99_us: result.p99_us,
                        errors: result.errors,
                    });
                }
                runs.sort_by(|a, b| a.cpu.total_cmp(&b.cpu));
                let mid = runs.swap_remove(runs.len() / 2);
                println!(
                    "{:>8} {:>6} PEs every {:>4} ms: CPU {:>5.1}%  answered {:>7.0}/s  per CPU s {:>8.0}  p99 {:>7} µs  errors {}",
                    if ours { "rserpool" } else { "rsplib" },
                    mid.pes,
                    mid.rereg_ms,
                    mid.cpu * 100.0,
                    mid.answered_per_s,
                    mid.per_cpu_second(),
                    mid.p99_us,
                    mid.errors
                );
                pair.push(mid);
            }
            rows.push(pair);
        }
    }
    drop(net);
    if let Some(path) = &args.markdown {
        write_section(path, "registrar-rsplib", &markdown(&rows, args.repeat))?;
    }
    Ok(())
}

fn markdown(rows: &[Vec<Run>], repeat: u32) -> String {
    use std::fmt::Write;
    let mut s = format!(
        "### rserpool's registrar and rsplib's under one load (`rserpool-bench registrar --against-rsplib`)\n\n{}\n",
        provenance()
    );
    let _ = writeln!(
        s,
        "Each registrar in a network namespace, the load generator's PEs re-registering over \
         SCTP in UDP from another; medians of {repeat} runs (by CPU). Registrations answered \
         per CPU second of the registrar; target: rserpool ≥ 3× rsplib.\n"
    );
    let _ = writeln!(
        s,
        "| PEs | re-reg every (ms) | CPU rserpool | CPU rsplib | answered/s rserpool | answered/s rsplib | per CPU s rserpool | per CPU s rsplib | rserpool / rsplib | p50 rserpool (µs) | p50 rsplib (µs) | p99 rserpool (µs) | p99 rsplib (µs) | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for pair in rows {
        let [o, r] = pair.as_slice() else { continue };
        let _ = writeln!(
            s,
            "| {} | {} | {:.1}% | {:.1}% | {:.0} | {:.0} | {:.0} | {:.0} | {:.2}× | {} | {} | {} | {} | {} |",
            o.pes,
            o.rereg_ms,
            o.cpu * 100.0,
            r.cpu * 100.0,
            o.answered_per_s,
            r.answered_per_s,
            o.per_cpu_second(),
            r.per_cpu_second(),
            o.per_cpu_second() / r.per_cpu_second().max(1e-9),
            o.p50_us,
            r.p50_us,
            o.p99_us,
            r.p99_us,
            o.errors + r.errors
        );
    }
    s.push('\n');
    s
}
