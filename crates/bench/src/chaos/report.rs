//! The soak's summary: what was run, the faults injected by kind, and each invariant's figure
//! (PEs lost, the longest time a live PE was missing, convergence times, failed requests), as
//! text for the terminal and as a Markdown section for docs/RELIABILITY.md.

use super::ChaosArgs;
use super::clients::Failure;
use super::faults::KINDS;
use super::fleet::{Kind, REGISTRAR_TIMERS, REREGISTRATION_MS};
use super::tier_clients::{DOWNLOAD, DOWNLOADERS, KEEPERS, TierTraffic};
use super::watch::Gap;
use crate::report::{median, provenance};
use std::fmt::Write;
use std::time::Duration;

/// What the soak was asked to do, and what it did, as it goes.
#[derive(Default)]
pub struct Record {
    duration_s: u64,
    settle_s: u64,
    clients: usize,
    rps: u32,
    tier_deaths: bool,
    pe_hosts: usize,
    /// Pool elements by kind: serve, example http, example echo.
    pe_kinds: [usize; 3],
    pub faults: [u32; KINDS.len()],
    pub restarts: u32,
    pub setup: Duration,
    pub episodes: Vec<Episode>,
    /// Processes that exited on their own.
    pub exits: Vec<String>,
    /// Upgrades whose successor took over, and those it did not (why).
    pub upgrades_handed: u32,
    pub upgrade_failures: Vec<String>,
    /// Tier connections broken (and kept-alive requests failed) in episodes where a tier proxy
    /// died holding at least that many on its own sockets, before their splice: the design's
    /// limit (docs/TIER.md), not counted against the invariant.
    pub tier_on_dying: u64,
    /// The longest wait after an episode until every tier proxy was a whole member again
    /// (linked, tables exchanged), and the episodes after which it was not within the settle
    /// bound: the next fault waits for it, since two members down at once is a double fault.
    pub tier_whole_longest: Option<(Duration, String)>,
    pub tier_not_whole: Vec<String>,
}

/// One episode's faults and its convergence time after healing (or why it did not converge).
pub struct Episode {
    pub label: String,
    pub outcome: Result<Duration, String>,
}

impl Record {
    pub fn new(args: &ChaosArgs, kinds: &[Kind], pe_hosts: usize) -> Record {
        let count = |k| kinds.iter().filter(|&&x| x == k).count();
        Record {
            duration_s: args.duration_s,
            settle_s: args.settle_s,
            clients: args.clients,
            rps: args.rps,
            tier_deaths: args.tier_deaths,
            tier_whole_longest: None,
            tier_not_whole: Vec::new(),
            pe_hosts,
            pe_kinds: [
                count(Kind::Serve),
                count(Kind::ExampleHttp),
                count(Kind::ExampleEcho),
            ],
            ..Record::default()
        }
    }
}

/// What the proxy tier's clients saw.
#[derive(Default)]
pub struct TierFigures {
    pub downloads: u64,
    pub bytes: u64,
    pub broken: u64,
    pub requests: u64,
    pub failed: u64,
    pub connects_retried: u64,
    pub findings: Vec<String>,
}

impl TierFigures {
    pub fn of(t: &TierTraffic) -> TierFigures {
        use std::sync::atomic::Ordering::Relaxed;
        TierFigures {
            downloads: t.downloads.load(Relaxed),
            bytes: t.bytes.load(Relaxed),
            broken: t.broken.load(Relaxed),
            requests: t.requests.load(Relaxed),
            failed: t.failed.load(Relaxed),
            connects_retried: t.connects_retried.load(Relaxed),
            findings: t.findings.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

pub struct Summary {
    pub record: Record,
    pub seed: u64,
    pub elapsed: Duration,
    /// The soak could not go on (setup failed, a command failed).
    pub error: Option<String>,
    pub longest: Option<Gap>,
    pub lost: Vec<Gap>,
    /// Each PE as the summary names it.
    pub pe_names: Vec<String>,
    pub sent: u64,
    pub failed: u64,
    pub failures: Vec<Failure>,
    pub tier: TierFigures,
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

impl Summary {
    fn gap(&self, g: &Gap) -> String {
        format!(
            "{} at r{}, from {:.1} s into the soak, during {}",
            self.pe_names.get(g.pe).map_or("?", String::as_str),
            g.registrar + 1,
            g.from.as_secs_f64(),
            g.context
        )
    }

    /// Tier connections broken and kept-alive requests failed that no dying proxy's sockets
    /// explain.
    fn tier_unexplained(&self) -> u64 {
        (self.tier.broken + self.tier.failed).saturating_sub(self.record.tier_on_dying)
    }

    /// PEs with a gap beyond the settle bound.
    fn lost_pes(&self) -> usize {
        let mut v: Vec<usize> = self.lost.iter().map(|g| g.pe).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    }

    fn converged(&self) -> Vec<(Duration, &str)> {
        self.record
            .episodes
            .iter()
            .filter_map(|e| e.outcome.as_ref().ok().map(|&d| (d, e.label.as_str())))
            .collect()
    }

    fn not_converged(&self) -> Vec<(&str, &str)> {
        self.record
            .episodes
            .iter()
            .filter_map(|e| {
                e.outcome
                    .as_ref()
                    .err()
                    .map(|w| (e.label.as_str(), w.as_str()))
            })
            .collect()
    }

    /// The invariants broken, empty if none.
    pub fn broken(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(e) = &self.error {
            v.push(format!("the soak stopped early: {e}"));
        }
        if !self.lost.is_empty() {
            v.push(format!("{} PE(s) lost", self.lost_pes()));
        }
        if self.failed > 0 {
            v.push(format!(
                "{} request(s) through the proxy failed",
                self.failed
            ));
        }
        let unexplained = self.tier_unexplained();
        if unexplained > 0 {
            v.push(format!(
                "{unexplained} connection(s) through the proxy tier broken or kept-alive \
                 request(s) failed, beyond what dying proxies held on their sockets"
            ));
        }
        if !self.record.upgrade_failures.is_empty() {
            v.push(format!(
                "{} upgrade(s) did not hand over",
                self.record.upgrade_failures.len()
            ));
        }
        let nc = self.not_converged().len();
        if nc > 0 {
            v.push(format!(
                "{nc} time(s) not converged within {} s",
                self.record.settle_s
            ));
        }
        if !self.record.tier_not_whole.is_empty() {
            v.push(format!(
                "{} time(s) the proxy tier was not whole again within {} s",
                self.record.tier_not_whole.len(),
                self.record.settle_s
            ));
        }
        if !self.record.exits.is_empty() {
            v.push(format!(
                "{} process(es) exited on their own",
                self.record.exits.len()
            ));
        }
        v
    }

    /// The figures, one (name, value) per row.
    fn rows(&self) -> Vec<(String, String)> {
        let r = &self.record;
        let mut rows = Vec::new();
        let total: u32 = r.faults.iter().sum();
        let by_kind: Vec<String> = KINDS
            .iter()
            .zip(r.faults)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        rows.push((
            "faults injected".into(),
            format!(
                "{total} in {} episodes: {}; {} processes restarted",
                r.episodes.len(),
                by_kind.join(", "),
                r.restarts
            ),
        ));
        let upgrades = r.upgrades_handed as usize + r.upgrade_failures.len();
        rows.push((
            "upgrades whose successor took over (must be all)".into(),
            format!("{} of {upgrades}", r.upgrades_handed),
        ));
        rows.push((
            "PEs lost (must be 0)".into(),
            match self.lost_pes() {
                0 => "0".into(),
                n => format!("**{n}**"),
            },
        ));
        rows.push((
            "longest time a live PE was missing from a live registrar".into(),
            match &self.longest {
                Some(g) => format!("{} ({})", secs(g.length), self.gap(g)),
                None => "never missing".into(),
            },
        ));
        let conv = self.converged();
        let mut ds: Vec<f64> = conv.iter().map(|(d, _)| d.as_secs_f64()).collect();
        ds.sort_by(f64::total_cmp);
        let max = conv.iter().max_by_key(|(d, _)| *d);
        rows.push((
            "convergence after a fault heals (every PE at every registrar, checksums agree)".into(),
            match (median(ds.clone()), max) {
                (Some(m), Some((d, label))) => format!(
                    "median {m:.2} s, 90th percentile {:.2} s, max {} (after {label})",
                    ds[(ds.len() * 9 / 10).min(ds.len() - 1)],
                    secs(*d)
                ),
                _ => "no fault healed".into(),
            },
        ));
        let nc = self.not_converged().len();
        rows.push((
            format!("not converged within the settle bound ({} s)", r.settle_s),
            if nc == 0 {
                "0".into()
            } else {
                format!("**{nc}**")
            },
        ));
        rows.push((
            "requests through the proxy (GET, idempotent)".into(),
            format!(
                "{} sent, {} failed",
                self.sent,
                if self.failed == 0 {
                    "0".into()
                } else {
                    format!("**{}**", self.failed)
                }
            ),
        ));
        let bold = |n: u64| {
            if n == 0 {
                "0".to_string()
            } else {
                format!("**{n}**")
            }
        };
        let t = &self.tier;
        rows.push((
            format!(
                "downloads through the proxy tier (kernel-spliced, {} MiB each, byte-exact)",
                DOWNLOAD >> 20
            ),
            format!(
                "{} completed ({:.1} GB in all), {} broken",
                t.downloads,
                t.bytes as f64 / 1e9,
                bold(t.broken)
            ),
        ));
        rows.push((
            "requests on kept-alive connections through the proxy tier".into(),
            format!(
                "{} sent, {} failed; {} connection attempts repeated (a SYN to a dead proxy)",
                t.requests,
                bold(t.failed),
                t.connects_retried
            ),
        ));
        rows.push((
            "of which on a dying tier proxy's sockets, before their splice (the design's limit)"
                .into(),
            r.tier_on_dying.to_string(),
        ));
        rows.push((
            "tier connections broken or requests failed beyond that (must be 0)".into(),
            bold(self.tier_unexplained()),
        ));
        rows.push((
            "longest wait until the tier was whole again (each member linked to the other, \
             tables exchanged) before the next fault"
                .into(),
            match &r.tier_whole_longest {
                Some((d, label)) => format!("{} (after {label})", secs(*d)),
                None => "always whole".into(),
            },
        ));
        rows.push((
            "processes that exited on their own".into(),
            match r.exits.len() {
                0 => "0".into(),
                n => format!("**{n}**"),
            },
        ));
        rows
    }

    fn setup(&self) -> String {
        let r = &self.record;
        let timers: Vec<String> = REGISTRAR_TIMERS
            .iter()
            .map(|(f, ms)| format!("{f} {ms}"))
            .collect();
        format!(
            "{} s of faults ({:.0} s in all), seed {}. 3 registrars (an ENRP cluster), {} PEs on \
             {} hosts ({} `serve` sidecars in front of HTTP targets, {} `example http`, {} \
             `example echo`), one HTTP proxy onto the HTTP pool, {} clients at {} requests/s in \
             all; each registrar, PE host and the proxy in a network namespace of its own. \
             Beside them a proxy tier: two kernel-splicing proxies behind a router whose \
             nexthop group `rserpool distributor` keeps (heartbeats every 100 ms), in front of \
             two `example http` servers that are never killed, all registered with the \
             cluster; {DOWNLOADERS} clients download {} MiB each in turn and {KEEPERS} send GETs \
             on kept-alive connections through it; {} \
             Registrar timers: {}; PE re-registration every {REREGISTRATION_MS} ms; settle bound \
             {} s. Setup converged in {}.",
            r.duration_s,
            self.elapsed.as_secs_f64(),
            self.seed,
            r.pe_kinds.iter().sum::<usize>(),
            r.pe_hosts,
            r.pe_kinds[0],
            r.pe_kinds[1],
            r.pe_kinds[2],
            r.clients,
            r.rps,
            DOWNLOAD >> 20,
            if r.tier_deaths {
                "its proxies are upgraded and their hosts die among the faults."
            } else {
                "its proxies are upgraded; their hosts do not die (`--tier-deaths false`)."
            },
            timers.join(", "),
            r.settle_s,
            secs(r.setup)
        )
    }

    /// The details behind a broken invariant, one line each.
    fn findings(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(e) = &self.error {
            v.push(format!("stopped early: {e}"));
        }
        for g in &self.lost {
            v.push(format!(
                "lost: {} (missing > {} s)",
                self.gap(g),
                self.record.settle_s
            ));
        }
        for (label, why) in self.not_converged() {
            v.push(format!("not converged after {label}: {why}"));
        }
        for why in &self.record.upgrade_failures {
            v.push(format!("upgrade: {why}"));
        }
        for why in &self.record.tier_not_whole {
            v.push(format!("proxy tier not whole: {why}"));
        }
        for f in &self.failures {
            v.push(format!(
                "{} request(s) failed from {:.1} s to {:.1} s during {}: {} (e.g. {})",
                f.count,
                f.first.as_secs_f64(),
                f.last.as_secs_f64(),
                f.context,
                f.error,
                f.example
            ));
        }
        v.extend(
            self.tier
                .findings
                .iter()
                .map(|f| format!("proxy tier: {f}")),
        );
        v.extend(self.record.exits.iter().cloned());
        v
    }

    /// "every invariant held", or `broken` and what broke.
    fn verdict(&self, broken: &str) -> String {
        let v = self.broken();
        if v.is_empty() {
            "every invariant held".into()
        } else {
            format!("{broken} — {}", v.join("; "))
        }
    }

    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "chaos soak: {}\n", self.setup());
        for (k, v) in self.rows() {
            let _ = writeln!(s, "{k}: {}", v.replace("**", ""));
        }
        let findings = self.findings();
        if !findings.is_empty() {
            let _ = writeln!(s, "\nfindings:");
            for f in findings {
                let _ = writeln!(s, "  {f}");
            }
        }
        let _ = writeln!(s, "\nverdict: {}", self.verdict("BROKEN"));
        s
    }

    pub fn markdown(&self) -> String {
        let mut s = provenance();
        let _ = writeln!(s, "{}\n", self.setup());
        let _ = writeln!(s, "| invariant / figure | result |\n|---|---|");
        for (k, v) in self.rows() {
            let _ = writeln!(s, "| {k} | {} |", v.replace('|', "\\|"));
        }
        let findings = self.findings();
        if !findings.is_empty() {
            let _ = writeln!(s, "\nFindings:\n");
            for f in findings {
                let _ = writeln!(s, "- {f}");
            }
        }
        let _ = writeln!(s, "\nVerdict: {}.\n", self.verdict("**broken**"));
        s
    }
}
