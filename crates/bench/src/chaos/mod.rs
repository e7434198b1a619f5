//! `rserpool-bench chaos`: a soak with real processes (docs/RELIABILITY.md). Three registrars (an
//! ENRP cluster), at least 50 pool elements (`serve` sidecars and `example` services), an HTTP
//! proxy and clients run in network namespaces for a set time, while faults are injected at
//! random from a seed: `kill -9` and restart of registrars and PEs, link cuts and packet loss
//! (see [`faults`]). The invariants are checked from outside all along ([`watch`]: every
//! registrar's status; [`clients`]: the requests through the proxy), and the run ends with a
//! summary ([`report`]) and a non-zero exit if one was broken: a PE lost, a failed request, no
//! convergence within the settle bound after a fault, or a process that exited on its own.
//! A proxy tier ([`tier`]) stands beside the HTTP proxy: two kernel-splicing proxies whose
//! hosts die and which are upgraded among the other faults, under long downloads and
//! kept-alive requests ([`tier_clients`]) of which none may break.

mod clients;
mod faults;
mod fleet;
pub(crate) mod netns;
mod report;
mod tier;
mod tier_clients;
mod watch;

use crate::process::wait_for;
use crate::undo::{self, TempDir};
use anyhow::{Context, Result, bail};
use clap::Args;
use faults::{Fault, Layout, Planner, Upgraded};
use fleet::{Fleet, Kind};
use netns::Net;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use watch::{Tracker, Who};

#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// How long faults are injected, seconds.
    #[arg(long, default_value_t = 600)]
    pub duration_s: u64,
    /// Pool elements (two in five `serve` sidecars, two `example http`, one `example echo`),
    /// ten per host.
    #[arg(long, default_value_t = 50)]
    pub pes: usize,
    /// Seed of the fault plan [default: from the clock; the summary names it].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Time the system has after a fault heals to converge again; a live PE missing from a
    /// live registrar for longer is lost. It covers a PE's longest back-off (10 s), its wait
    /// for a takeover (5 s) and the registrars' takeover (about 3 s).
    #[arg(long, default_value_t = 20)]
    pub settle_s: u64,
    /// Concurrent clients sending GETs through the proxy.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Requests per second of all clients together.
    #[arg(long, default_value_t = 100)]
    pub rps: u32,
    /// Longest cut of a registrar's link, ms. Cuts longer than the registrars' takeover time
    /// (about 2.5 s, more with TCP's retransmission back-off) make the registrar cut off and
    /// the others take each other over, then meet again.
    #[arg(long, default_value_t = 8000)]
    pub registrar_cut_max_ms: u64,
    /// Keep every process's log in this directory [default: a temporary one, kept only when
    /// an invariant is broken].
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
    /// Whether the proxy tier's proxies die with their hosts among the faults (they are
    /// upgraded either way). A connection in its first moments, before its proxy spliced it,
    /// dies with that proxy (docs/TIER.md) and is counted apart; CI's one-minute run leaves the
    /// deaths to the long runs and the tier tests.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub tier_deaths: bool,
    /// Only the proxy tier's faults (its proxies' host deaths and upgrades), for a close look
    /// at the tier; the rest of the soak runs undisturbed.
    #[arg(long)]
    pub only_tier: bool,
    /// Write the summary as a Markdown section into this file (e.g. docs/RELIABILITY.md).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
}

/// How long an upgrade's successor may take to serve: its first fetch of the pools (5 s at
/// most) and the old process's answer (10 s at most).
const UPGRADE_BOUND: Duration = Duration::from_secs(15);
/// How long after a dead tier proxy's host is back a break may still be what it held: the
/// client's retransmission, backed off while the host was away, meets the new stack then.
const TIER_LATE: Duration = Duration::from_secs(15);

pub fn run(args: ChaosArgs, rserpool: &Path) -> Result<()> {
    if args.pes == 0 || args.clients == 0 || args.rps == 0 {
        bail!("--pes, --clients and --rps must be at least 1");
    }
    netns::preflight()?;
    undo::on_signal()?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let (logs, tmp) = match &args.logs {
        Some(d) => (d.clone(), None),
        None => {
            let d = std::env::temp_dir().join(format!("rserpool-chaos-{}", std::process::id()));
            (d.clone(), Some(TempDir::new(d)))
        }
    };
    std::fs::create_dir_all(&logs)?;
    let names = fleet::host_names(args.pes);
    let mut net = Net::create(&names.iter().map(String::as_str).collect::<Vec<_>>())?;
    let host = |name: &str| fleet::host_index(args.pes, name).context("the tier's hosts");
    let servers = [host("ts1")?, host("ts2")?];
    let tier = tier::attach(&mut net, host("trouter")?, &servers)?;
    let fleet = Fleet::plan(&net, &tier, args.pes, rserpool, &logs)?;
    println!(
        "chaos soak: {} s, seed {seed}, {} PEs on {} hosts, a proxy tier of {}, logs in {}",
        args.duration_s,
        args.pes,
        fleet::faulted_hosts(args.pes) - 3,
        tier.proxies.len(),
        logs.display()
    );
    let mut soak = Soak::new(net, tier, fleet, &args, seed)?;
    let result = soak.run(&args);
    let summary = soak.stop(result.as_ref().err());
    println!("\n{}", summary.text());
    if let Some(path) = &args.markdown {
        crate::report::write_section(path, "chaos", &summary.markdown())?;
    }
    let broken = summary.broken();
    match (broken.is_empty(), tmp) {
        (true, _) => Ok(()),
        (false, tmp) => {
            if let Some(t) = tmp {
                println!("logs kept in {}", t.keep().display());
            }
            bail!("invariants broken: {}", broken.join("; "))
        }
    }
}

/// The running soak: the network, the processes, what watches them and what it has seen.
struct Soak {
    start: Instant,
    settle: Duration,
    seed: u64,
    rt: tokio::runtime::Runtime,
    tracker: Arc<Mutex<Tracker>>,
    requests: Arc<clients::Requests>,
    stop_poll: Arc<AtomicBool>,
    stop_clients: Arc<AtomicBool>,
    clients: Option<tokio::task::JoinHandle<()>>,
    tier_traffic: Arc<tier_clients::TierTraffic>,
    tier_clients: Vec<std::thread::JoinHandle<()>>,
    /// Connections killed tier proxies held on their sockets, not yet matched with a break,
    /// and until when they may be (unset while the host is dead).
    tier_held: Option<(u64, Option<Instant>)>,
    /// Tier breaks counted so far by [`Soak::account_tier`].
    tier_seen: u64,
    planner: Planner,
    record: report::Record,
    // Last: the processes go before their network.
    fleet: Fleet,
    tier: tier::Tier,
    net: Net,
}

impl Soak {
    fn new(net: Net, tier: tier::Tier, fleet: Fleet, args: &ChaosArgs, seed: u64) -> Result<Soak> {
        let start = Instant::now();
        let settle = Duration::from_secs(args.settle_s);
        let pe_hosts: Vec<usize> = fleet.pes.iter().map(|&m| fleet.members[m].host).collect();
        let pe_ids: Vec<u32> = fleet
            .pes
            .iter()
            .filter_map(|&m| fleet.members[m].pe_id)
            .collect();
        // The registrars' and the PEs' hosts.
        let hosts = fleet::faulted_hosts(args.pes);
        let tracker = Tracker::new(start, settle, pe_ids, &pe_hosts, net.hosts.len());
        let kinds = fleet
            .pes
            .iter()
            .map(|&m| fleet.members[m].kind)
            .collect::<Vec<_>>();
        Ok(Soak {
            start,
            settle,
            seed,
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?,
            tracker: Arc::new(Mutex::new(tracker)),
            requests: Arc::default(),
            stop_poll: Arc::default(),
            stop_clients: Arc::default(),
            clients: None,
            tier_traffic: Arc::default(),
            tier_clients: Vec::new(),
            tier_held: None,
            tier_seen: 0,
            planner: Planner::new(
                seed,
                Layout {
                    pe_hosts,
                    hosts,
                    registrar_cut_max: Duration::from_millis(args.registrar_cut_max_ms.max(500)),
                    tier_proxies: tier.proxies.len(),
                    tier_deaths: args.tier_deaths,
                    only_tier: args.only_tier,
                },
            ),
            record: report::Record::new(args, &kinds, hosts - 3),
            fleet,
            tier,
            net,
        })
    }

    fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&mut self, args: &ChaosArgs) -> Result<()> {
        self.rt.spawn(watch::poll(
            self.fleet.status.clone(),
            self.tracker.clone(),
            self.stop_poll.clone(),
        ));
        // Setup: registrars, then targets and PEs, until converged; then the proxy.
        let t = Instant::now();
        self.tracker().mark(t);
        for r in 0..3 {
            self.start_member(self.fleet.registrars[r], true)?;
        }
        let targets: Vec<usize> = (0..self.fleet.members.len())
            .filter(|&m| self.fleet.members[m].kind == Kind::Target)
            .collect();
        for m in targets {
            self.start_member(m, true)?;
        }
        for k in 0..self.fleet.pes.len() {
            self.start_member(self.fleet.pes[k], true)?;
        }
        let limit = Duration::from_secs(60);
        if !self.converge(t, limit) {
            bail!(
                "setup: not converged within {limit:?}: {}",
                self.tracker().why_not
            );
        }
        self.record.setup = t.elapsed();
        println!("setup converged in {:.1} s", t.elapsed().as_secs_f64());
        self.start_member(self.fleet.proxy, true)?;
        let front = self.fleet.front;
        let rt = &self.rt;
        wait_for("the proxy", Duration::from_secs(20), || {
            rt.block_on(async {
                match rserpool_proxy::http::client::Client::connect(front).await {
                    Ok(mut c) => c.get("/").await.is_ok_and(|r| r.code == 200),
                    Err(_) => false,
                }
            })
        })?;
        let tracker = self.tracker.clone();
        let context = move || tracker.lock().unwrap_or_else(|p| p.into_inner()).context();
        self.clients = Some(self.rt.spawn(clients::run(
            front,
            args.clients,
            args.rps,
            self.start,
            context,
            self.stop_clients.clone(),
            self.requests.clone(),
        )));
        self.start_tier()?;
        // The faults.
        let end = Instant::now() + Duration::from_secs(args.duration_s);
        let mut n = 0;
        while Instant::now() < end {
            n += 1;
            let (faults, pause) = self.planner.episode();
            self.episode(n, &faults)?;
            self.idle_until(Instant::now() + pause)?;
        }
        self.tracker().set_context("after the last fault".into());
        Ok(())
    }

    /// Starts the proxy tier (its distributor, servers, then proxies) and, once the router's
    /// group holds every proxy and a GET passes, its clients.
    fn start_tier(&mut self) -> Result<()> {
        for m in self.fleet.tier.clone() {
            self.start_member(m, true)?;
        }
        let t = Instant::now();
        let want = self.tier.proxies.len();
        let ns = self.tier.client_ns.clone();
        loop {
            if self.tier.group_members(&self.net) == want && tier_clients::reachable(&ns) {
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!(
                    "setup: the proxy tier did not come up within 60 s (group of {} of {want})",
                    self.tier.group_members(&self.net)
                );
            }
            self.idle_until(Instant::now() + Duration::from_millis(200))?;
        }
        println!("proxy tier up in {:.1} s", t.elapsed().as_secs_f64());
        let tracker = self.tracker.clone();
        let cx = tier_clients::Context {
            start: self.start,
            now: Arc::new(move || tracker.lock().unwrap_or_else(|p| p.into_inner()).context()),
        };
        self.tier_clients = tier_clients::start(
            &ns,
            cx,
            self.stop_clients.clone(),
            self.tier_traffic.clone(),
        );
        Ok(())
    }

    /// Starts member `m` and tells the tracker.
    fn start_member(&mut self, m: usize, first: bool) -> Result<()> {
        self.fleet.start(&self.net, m)?;
        if let Some(who) = self.who(m) {
            self.tracker().set_running(who, true, Instant::now());
        }
        if !first {
            self.record.restarts += 1;
        }
        Ok(())
    }

    fn kill_member(&mut self, m: usize) {
        if let Some(who) = self.who(m) {
            self.tracker().set_running(who, false, Instant::now());
        }
        self.fleet.kill(m);
    }

    /// Connections through the tier broken and kept-alive requests failed, so far.
    fn tier_breaks(&self) -> u64 {
        let t = &self.tier_traffic;
        t.broken.load(Ordering::Relaxed) + t.failed.load(Ordering::Relaxed)
    }

    /// Counts the tier breaks since the last call (`when`: a note for the printout) and how
    /// many of them the connections a killed proxy held on its sockets explain. Such a break
    /// may show only once the dead host is back (its new stack resets the client's
    /// retransmission), after the episode: what was held stays to explain breaks until
    /// [`TIER_LATE`] after the heal.
    fn account_tier(&mut self, when: &str) {
        let total = self.tier_breaks();
        let new = total - self.tier_seen;
        self.tier_seen = total;
        if self
            .tier_held
            .is_some_and(|(_, until)| until.is_some_and(|u| Instant::now() > u))
        {
            self.tier_held = None;
        }
        if new == 0 {
            return;
        }
        let dying = self.tier_held.as_mut().map_or(0, |(held, _)| {
            let d = new.min(*held);
            *held -= d;
            d
        });
        self.record.tier_on_dying += dying;
        let when = if when.is_empty() {
            String::new()
        } else {
            format!(" {when}")
        };
        println!(
            "           {new} tier connection(s) broken or request(s) failed{when}, {dying} of \
             them explained by a dying proxy's sockets"
        );
    }

    fn who(&self, m: usize) -> Option<Who> {
        if let Some(r) = self.fleet.registrars.iter().position(|&x| x == m) {
            return Some(Who::Registrar(r));
        }
        self.fleet.pes.iter().position(|&x| x == m).map(Who::Pe)
    }

    /// One episode: its faults start together, each heals after its duration; then the
    /// convergence time is measured.
    fn episode(&mut self, n: usize, faults: &[Fault]) -> Result<()> {
        let label = format!(
            "#{n} {}",
            faults
                .iter()
                .map(|f| self.describe(f))
                .collect::<Vec<_>>()
                .join(" + ")
        );
        println!("{:7.1} s  {label}", self.start.elapsed().as_secs_f64());
        self.tracker().set_context(label.clone());
        let failed_before = self.requests.failed.load(Ordering::Relaxed);
        self.account_tier("in the pause before it");
        let t0 = Instant::now();
        for f in faults {
            self.record.faults[f.kind()] += 1;
            self.inject(f)?;
        }
        let mut heals: Vec<&Fault> = faults.iter().collect();
        heals.sort_by_key(|f| f.duration());
        for f in heals {
            self.idle_until(t0 + f.duration())?;
            self.heal(f)?;
        }
        let healed = Instant::now();
        self.tracker().mark(healed);
        let converged = self.converge(healed, self.settle);
        let outcome = if converged {
            let d = self
                .tracker()
                .converged_after_mark()
                .map_or(Duration::ZERO, |t| t.saturating_duration_since(healed));
            println!(
                "           converged {:.2} s after healing",
                d.as_secs_f64()
            );
            Ok(d)
        } else {
            let why = self.tracker().why_not.clone();
            println!("           NOT converged within {:?}: {why}", self.settle);
            Err(why)
        };
        self.await_tier_whole(&label)?;
        let failed = self.requests.failed.load(Ordering::Relaxed) - failed_before;
        if failed > 0 {
            println!("           {failed} request(s) through the proxy failed");
        }
        self.account_tier("");
        self.tracker()
            .set_context(format!("the pause after {label}"));
        self.record
            .episodes
            .push(report::Episode { label, outcome });
        Ok(())
    }

    /// Waits, at most the settle bound, until the router's group holds every tier proxy and
    /// each is a whole member again (linked to the others, their tables arrived, answering
    /// the distributor). The next fault waits for it: killing a member before the one that
    /// came back has the other's table is a double fault, beyond what the tier survives.
    fn await_tier_whole(&mut self, label: &str) -> Result<()> {
        let t = Instant::now();
        let n = self.tier.proxies.len();
        loop {
            let whole = self.tier.group_members(&self.net) == n
                && (0..n).all(|i| tier::whole(&self.net, self.tier.router, i, n) == Some(true));
            if whole {
                break;
            }
            if t.elapsed() >= self.settle {
                let why = format!("after {label}, within {:?}", self.settle);
                println!("           proxy tier NOT whole again {why}");
                self.record.tier_not_whole.push(why);
                return Ok(());
            }
            self.idle_until(Instant::now() + Duration::from_millis(100))?;
        }
        let d = t.elapsed();
        if d >= Duration::from_millis(100) {
            println!(
                "           proxy tier whole again {:.2} s later",
                d.as_secs_f64()
            );
        }
        let r = &mut self.record;
        if r.tier_whole_longest.as_ref().is_none_or(|(l, _)| d > *l) {
            r.tier_whole_longest = Some((d, label.to_string()));
        }
        Ok(())
    }

    fn describe(&self, f: &Fault) -> String {
        let host = |h: usize| self.net.hosts[h].name.clone();
        let pe = |k: usize| {
            let m = &self.fleet.members[self.fleet.pes[k]];
            format!(
                "{} ({}, {:#x})",
                m.name,
                m.kind.label(),
                m.pe_id.unwrap_or(0)
            )
        };
        let s = |d: Duration| format!("{:.1} s", d.as_secs_f64());
        match f {
            Fault::KillRegistrar { r, down } => {
                format!("kill -9 registrar r{} for {}", r + 1, s(*down))
            }
            Fault::KillPes { pes, down } => format!(
                "kill -9 {} for {}",
                pes.iter().map(|&k| pe(k)).collect::<Vec<_>>().join(", "),
                s(*down)
            ),
            Fault::CutLink { host: h, down } => {
                format!("link of {} cut for {}", host(*h), s(*down))
            }
            Fault::Loss {
                host: h,
                percent,
                hold,
            } => format!("{percent} % loss on {} for {}", host(*h), s(*hold)),
            Fault::Upgrade { who, .. } => match who {
                Upgraded::Proxy => "upgrade of the proxy".into(),
                Upgraded::Registrar(r) => format!("upgrade of registrar r{}", r + 1),
                Upgraded::TierProxy(p) => format!("upgrade of tier proxy tp{}", p + 1),
            },
            Fault::KillTierProxy { p, down } => {
                format!("host of tier proxy tp{} dead for {}", p + 1, s(*down))
            }
        }
    }

    /// The member an upgrade replaces.
    fn upgraded(&self, who: Upgraded) -> usize {
        match who {
            Upgraded::Proxy => self.fleet.proxy,
            Upgraded::Registrar(r) => self.fleet.registrars[r],
            Upgraded::TierProxy(p) => self.fleet.tier_proxies[p],
        }
    }

    fn inject(&mut self, f: &Fault) -> Result<()> {
        match f {
            Fault::KillRegistrar { r, .. } => self.kill_member(self.fleet.registrars[*r]),
            Fault::KillPes { pes, .. } => {
                for &k in pes {
                    self.kill_member(self.fleet.pes[k]);
                }
            }
            Fault::CutLink { host, .. } => {
                self.tracker().set_cut(*host, true, Instant::now());
                self.net.set_link(*host, false)?;
            }
            Fault::Loss { host, percent, .. } => self.net.set_loss(*host, *percent)?,
            Fault::Upgrade { who, .. } => {
                let m = self.upgraded(*who);
                self.fleet.upgrade(&self.net, m)?;
            }
            Fault::KillTierProxy { p, .. } => {
                let m = self.fleet.tier_proxies[*p];
                // What it holds on its sockets, not yet spliced, dies with it (docs/TIER.md).
                let held = tier::on_sockets(&self.net, self.tier.router, *p);
                let (n, _) = self.tier_held.get_or_insert((0, None));
                *n += held.unwrap_or(0);
                self.kill_member(m);
                self.net.set_link(self.fleet.members[m].host, false)?;
            }
        }
        Ok(())
    }

    fn heal(&mut self, f: &Fault) -> Result<()> {
        match f {
            Fault::KillRegistrar { r, .. } => {
                self.start_member(self.fleet.registrars[*r], false)?
            }
            Fault::KillPes { pes, .. } => {
                for &k in pes {
                    self.start_member(self.fleet.pes[k], false)?;
                }
            }
            Fault::CutLink { host, .. } => {
                self.net.set_link(*host, true)?;
                self.tracker().set_cut(*host, false, Instant::now());
            }
            Fault::Loss { host, .. } => self.net.set_loss(*host, 0)?,
            Fault::KillTierProxy { p, .. } => {
                let m = self.fleet.tier_proxies[*p];
                if let Some((_, until)) = &mut self.tier_held {
                    *until = Some(Instant::now() + TIER_LATE);
                }
                self.net.set_link(self.fleet.members[m].host, true)?;
                self.start_member(m, false)?;
            }
            Fault::Upgrade { who, .. } => {
                // The successor says it serves once the old process stopped.
                let m = self.upgraded(*who);
                // It may take a while: the new proxy fetches its pools first, maybe past a
                // registrar whose link is cut in the same episode.
                let log = self.fleet.log(m);
                let deadline = Instant::now() + UPGRADE_BOUND;
                let handed = loop {
                    if std::fs::read_to_string(&log).is_ok_and(|l| l.contains("; this one serves"))
                    {
                        break true;
                    }
                    if Instant::now() >= deadline {
                        break false;
                    }
                    self.idle_until(Instant::now() + Duration::from_millis(100))?;
                };
                if handed {
                    self.record.upgrades_handed += 1;
                } else {
                    let why = format!(
                        "{} did not take over within {} s; log {}",
                        self.fleet.members[m].name,
                        UPGRADE_BOUND.as_secs(),
                        log.display()
                    );
                    println!("           {why}");
                    self.record.upgrade_failures.push(why);
                }
            }
        }
        Ok(())
    }

    /// Waits until the tracker has seen convergence after `mark`, at most `limit`.
    fn converge(&mut self, mark: Instant, limit: Duration) -> bool {
        let deadline = mark + limit;
        loop {
            if self.tracker().converged_after_mark().is_some() {
                return true;
            }
            if Instant::now() >= deadline
                || self.idle_until(Instant::now() + watch::POLL / 4).is_err()
            {
                return self.tracker().converged_after_mark().is_some();
            }
        }
    }

    /// Sleeps until `t`, watching for processes that exit on their own: each is a finding,
    /// and is started again so that the soak goes on.
    fn idle_until(&mut self, t: Instant) -> Result<()> {
        loop {
            for (m, status) in self.fleet.exits() {
                let member = &self.fleet.members[m];
                let finding = format!(
                    "{} ({}) exited on its own ({status}) during {}; log {}",
                    member.name,
                    member.kind.label(),
                    self.tracker().context(),
                    self.fleet.log(m).display()
                );
                println!("           {finding}");
                self.record.exits.push(finding);
                if let Some(who) = self.who(m) {
                    self.tracker().set_running(who, false, Instant::now());
                }
                self.start_member(m, false)?;
            }
            let now = Instant::now();
            if now >= t {
                return Ok(());
            }
            std::thread::sleep((t - now).min(Duration::from_millis(50)));
        }
    }

    /// After the last fault: a last convergence, then everything stops; the summary.
    fn stop(&mut self, error: Option<&anyhow::Error>) -> report::Summary {
        if error.is_none() {
            let t = Instant::now();
            self.tracker().mark(t);
            if !self.converge(t, self.settle) {
                let why = self.tracker().why_not.clone();
                self.record.episodes.push(report::Episode {
                    label: "end of the soak".into(),
                    outcome: Err(why),
                });
            }
        }
        self.stop_clients.store(true, Ordering::Relaxed);
        if let Some(c) = self.clients.take() {
            let _ = self.rt.block_on(c);
        }
        for t in std::mem::take(&mut self.tier_clients) {
            if let Err(panic) = t.join() {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.tier_traffic.broken.fetch_add(1, Ordering::Relaxed);
                self.tier_traffic
                    .finding(format!("a client thread panicked: {why}"));
            }
        }
        self.account_tier("after the last episode");
        self.stop_poll.store(true, Ordering::Relaxed);
        self.tracker().finish(Instant::now());
        let record = std::mem::take(&mut self.record);
        let pe_names = self
            .fleet
            .pes
            .iter()
            .map(|&m| {
                let member = &self.fleet.members[m];
                format!(
                    "{} ({}, {:#x})",
                    member.name,
                    member.kind.label(),
                    member.pe_id.unwrap_or(0)
                )
            })
            .collect();
        let tracker = self.tracker();
        let requests = &self.requests;
        report::Summary {
            record,
            seed: self.seed,
            elapsed: self.start.elapsed(),
            error: error.map(|e| format!("{e:#}")),
            longest: tracker.longest.clone(),
            lost: tracker.lost.clone(),
            pe_names,
            sent: requests.sent.load(Ordering::Relaxed),
            failed: requests.failed.load(Ordering::Relaxed),
            failures: requests
                .failures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            tier: report::TierFigures::of(&self.tier_traffic),
        }
    }
}
