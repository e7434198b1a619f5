//! `rserpool serve --agent` against a real HAProxy (Debian's `haproxy`; `.ci/run` installs it):
//! HAProxy polls the agent and its stats socket shows the server's weight follow the credits
//! of the target, and the server go down when the target stops answering. Without haproxy the
//! test is skipped, except under `CI`, where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{KillOnDrop, Logged, fast_config, free_port, registrar, wait_until};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The `weight` and `status` of server `b/s1` from HAProxy's `show stat`.
fn server_stat(socket: &Path) -> Option<(u32, String)> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.write_all(b"show stat\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next()?.trim_start_matches("# ").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (w, st) = (col("weight")?, col("status")?);
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .find_map(|row| {
            (row.first() == Some(&"b") && row.get(1) == Some(&"s1"))
                .then(|| Some((row.get(w)?.parse().ok()?, row.get(st)?.to_string())))?
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_follows_the_agent_check() {
    if !common::haproxy_here() {
        return;
    }
    let reg = registrar(fast_config());
    // The target: holds the work's connections, closes the sidecar's health checks at once.
    let t = common::HoldingTarget::start();
    let target_addr = t.addr;
    let agent = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _serve = Logged::spawn(
        "serve",
        &[
            "serve",
            "--target",
            &target_addr.to_string(),
            "--pool",
            "AgentPool",
            "--policy",
            "credits",
            "--capacity",
            "4",
            "--agent",
            &agent.to_string(),
            "--check-interval-ms",
            "100",
            "--registrar",
            &reg.asap_addr().to_string(),
        ]
        .map(String::from),
        "info",
    );
    wait_until(Duration::from_secs(10), "the agent listens", || {
        TcpStream::connect(agent).is_ok()
    })
    .await;

    let dir = std::env::temp_dir().join(format!("rserpool-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("stats.sock");
    let front = free_port();
    let cfg = format!(
        "global\n  stats socket {} mode 600 level admin\n\
         defaults\n  mode tcp\n  timeout connect 1s\n  timeout client 10s\n  timeout server 10s\n\
         frontend f\n  bind 127.0.0.1:{front}\n  default_backend b\n\
         backend b\n  server s1 {target_addr} weight 100 agent-check agent-addr {} agent-port {} agent-inter 100ms\n",
        socket.display(),
        agent.ip(),
        agent.port()
    );
    let cfg_path = dir.join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).unwrap();
    let _haproxy = KillOnDrop(
        Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&cfg_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stat = || server_stat(&socket);
    wait_until(Duration::from_secs(10), "HAProxy at full weight", || {
        stat().is_some_and(|(w, _)| w == 100)
    })
    .await;

    // Two connections being served: credits 2 of 4, half the weight.
    let _busy: Vec<TcpStream> = (0..2).map(|_| t.connect()).collect();
    wait_until(Duration::from_secs(5), "HAProxy at half weight", || {
        stat().is_some_and(|(w, _)| w == 50)
    })
    .await;

    // The target stops answering: the agent says down. (Shutting the listening socket down
    // stops it listening, and ends the accept thread, which holds a clone.)
    rustix::net::shutdown(&t.listener, rustix::net::Shutdown::Both).unwrap();
    t.held.lock().unwrap().clear();
    drop(t);
    drop(_busy);
    wait_until(
        Duration::from_secs(5),
        "HAProxy marks the server down",
        || stat().is_some_and(|(_, s)| s.starts_with("DOWN")),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
