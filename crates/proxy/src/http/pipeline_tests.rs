//! The pipeline's decisions, in process: [`forward`] with a real client socket and real PEs on
//! loopback (one that refuses, one that closes without answering, one that answers, one that
//! closes its kept-alive connections), no registrar. The pool's policy is "least used" with
//! fixed loads, so which PE is tried first is known.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::testbed::*;
use crate::balance::pools::Pool;
use crate::config::ProxyConfig;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_pe_that_refuses_is_reported_and_the_next_one_answers() {
    let (a, _) = pe(Pe::Refuses).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(keep);
    assert_eq!(b_seen.load(Ordering::Relaxed), 1);
    assert_eq!(reported(&mut reports), [1], "the refusing PE, and only it");
    let failovers = |id: u32| {
        pool.backends()
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.stats.failovers.load(Ordering::Relaxed))
    };
    assert_eq!(failovers(1), Some(1));
    assert_eq!(failovers(2), Some(0));
}

#[tokio::test]
async fn no_pe_answering_is_a_502_and_an_empty_pool_a_503_with_retry_after() {
    let (a, _) = pe(Pe::Refuses).await;
    let (b, _) = pe(Pe::Refuses).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 502"), "{got}");
    assert!(got.contains("no pool element answered"), "{got}");
    assert!(!keep);
    let mut ids = reported(&mut reports);
    ids.sort_unstable();
    assert_eq!(ids, [1, 2]);

    let (ctx, pool, _) = self::ctx(&[], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("Retry-After: 1"), "{got}");
}

#[tokio::test]
async fn an_idempotent_request_goes_once_more_after_a_pe_closed_without_answering() {
    let (a, a_seen) = pe(Pe::Drops).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(a_seen.load(Ordering::Relaxed), 1, "first to the least used");
    assert_eq!(
        b_seen.load(Ordering::Relaxed),
        1,
        "then once more elsewhere"
    );
    assert_eq!(reported(&mut reports), [1]);
}

#[tokio::test]
async fn a_request_that_is_not_idempotent_is_not_sent_again() {
    let (a, a_seen) = pe(Pe::Drops).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, POST, "hi").await;
    assert!(got.starts_with("HTTP/1.1 502"), "{got}");
    assert!(got.contains("closed the connection"), "{got}");
    assert!(!keep);
    assert_eq!(a_seen.load(Ordering::Relaxed), 1);
    assert_eq!(
        b_seen.load(Ordering::Relaxed),
        0,
        "a POST may have been processed"
    );
    assert_eq!(reported(&mut reports), [1]);
}

#[tokio::test]
async fn a_stale_kept_alive_connection_costs_the_pe_nothing() {
    let (a, a_seen) = pe(Pe::AnswersOnce).await;
    let (ctx, pool, mut reports) = ctx(&[a], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // The PE closed the connection the proxy keeps for reuse; the next request finds it so.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(a_seen.load(Ordering::Relaxed), 2);
    assert!(reported(&mut reports).is_empty(), "not the PE's fault");
    let b = &pool.backends()[0];
    assert_eq!(b.stats.failures.load(Ordering::Relaxed), 0);
    assert_eq!(b.stats.connections.load(Ordering::Relaxed), 2);
}

/// A request the PE does not answer within `request-timeout-ms` (a long poll, a hung
/// handler) makes it busy, not ejected: else any client could eject a PE with a slow call.
#[tokio::test]
async fn a_pe_that_does_not_answer_in_time_is_a_504_and_busy_not_ejected() {
    let (a, _) = pe(Pe::Silent).await;
    let cfg = ProxyConfig {
        request_timeout_ms: 200,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a], cfg);
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
    assert!(!keep);
    let b = &pool.backends()[0];
    assert_eq!(b.stats.failures.load(Ordering::Relaxed), 0);
    assert_eq!(b.stats.busy.load(Ordering::Relaxed), 1);
    assert!(!b.is_ejected(Instant::now()), "ejected for one slow answer");
    assert!(reported(&mut reports).is_empty(), "slow is not unreachable");
}

#[tokio::test]
async fn a_pe_whose_accept_queue_is_full_is_busy_not_dead() {
    let (a, _) = pe(Pe::Full).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let cfg = ProxyConfig {
        connect_timeout_ms: 200,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a, b], cfg);
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let busy = pe_stats(&pool, 1);
    assert_eq!(busy.stats.busy.load(Ordering::Relaxed), 1);
    assert_eq!(
        busy.stats.ejections.load(Ordering::Relaxed),
        0,
        "overload is not death"
    );
    assert!(
        reported(&mut reports).is_empty(),
        "and not reported to the registrar"
    );
    // While it is busy, new work goes elsewhere at once (no second connect timeout).
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(started.elapsed() < Duration::from_millis(150));
    assert_eq!(busy.stats.busy.load(Ordering::Relaxed), 1);
    assert_eq!(b_seen.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn with_every_pe_busy_the_request_tries_them_again_as_their_queues_drain() {
    let a = full_for(Duration::from_millis(700));
    let cfg = ProxyConfig {
        connect_timeout_ms: 300,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a], cfg);
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    let b = pe_stats(&pool, 1);
    assert!(b.stats.busy.load(Ordering::Relaxed) >= 2);
    assert_eq!(b.stats.ejections.load(Ordering::Relaxed), 0);
    assert!(reported(&mut reports).is_empty());
}

#[tokio::test]
async fn an_ejection_never_takes_more_than_the_cap_of_a_pool() {
    let mut pes = Vec::new();
    for _ in 0..3 {
        pes.push(pe(Pe::Refuses).await.0);
    }
    let (d, d_seen) = pe(Pe::Answers).await;
    pes.push(d);
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(
        crate::config::PoolConfig {
            panic_threshold: 0,
            ..Default::default()
        },
        None,
    );
    for _ in 0..3 {
        let (_, got) = one(&ctx, &pool, GET, "").await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }
    assert_eq!(d_seen.load(Ordering::Relaxed), 3);
    let now = Instant::now();
    let ejected = pool.backends().iter().filter(|b| b.is_ejected(now)).count();
    // 10 % of 4 PEs, but at least one.
    assert_eq!(ejected, 1);
    let capped: u64 = pool
        .backends()
        .iter()
        .map(|b| b.stats.ejections_capped.load(Ordering::Relaxed))
        .sum();
    assert!(
        capped >= 2,
        "the other refusals were counted, not ejected ({capped})"
    );
}

#[tokio::test]
async fn with_too_few_healthy_pes_the_pool_panics_and_spreads_over_all() {
    let (pes, seen) = answering(4).await;
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(
        crate::config::PoolConfig {
            max_ejection_percent: 100,
            ..Default::default()
        },
        None,
    );
    // Three of four ejected (by failures of their own).
    for id in 1..=3 {
        assert!(pe_stats(&pool, id).failed(&ctx.pools.settings.health, true));
    }
    // 1 of 4 healthy is below the default threshold (50 %): the least used PE, ejected or
    // not, gets the request.
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(
        seen[0].load(Ordering::Relaxed),
        1,
        "panic: ejected PEs serve too"
    );
    // Without panic mode the healthy one takes it all.
    pool.set_config(
        crate::config::PoolConfig {
            max_ejection_percent: 100,
            panic_threshold: 0,
            ..Default::default()
        },
        None,
    );
    for id in 1..=3 {
        pe_stats(&pool, id).failed(&ctx.pools.settings.health, true);
    }
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(seen[3].load(Ordering::Relaxed), 1);
    assert_eq!(seen[0].load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn retries_stay_within_the_pools_retry_budget() {
    let (a, _) = pe(Pe::Drops).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, _) = ctx(&[a, b], ProxyConfig::default());
    // No budget at all: a request a PE took and dropped is not sent again.
    pool.set_config(
        crate::config::PoolConfig {
            retry_budget_percent: 0,
            retry_budget_min: 0,
            ..Default::default()
        },
        None,
    );
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("retry budget"), "{got}");
    assert!(!keep);
    assert_eq!(pool.retries_refused(), 1);
    assert_eq!(b_seen.load(Ordering::Relaxed), 0);
    // The default budget (3, or 20 % of the requests under way) has room for it.
    pool.set_config(crate::config::PoolConfig::default(), None);
    pe_stats(&pool, 1).succeeded();
    pe_stats(&pool, 2).succeeded();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(pool.retries_refused(), 1);
}

/// Which PE served a request with this user (their counters before and after).
async fn served_by(
    ctx: &crate::ctx::Ctx,
    pool: &Arc<Pool>,
    seen: &[Arc<std::sync::atomic::AtomicUsize>],
    user: &str,
) -> usize {
    let before: Vec<usize> = seen.iter().map(|s| s.load(Ordering::Relaxed)).collect();
    let text = format!("GET / HTTP/1.1\r\nHost: x\r\nX-User: {user}\r\n\r\n");
    let (_, got) = one(ctx, pool, &text, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    (0..seen.len())
        .find(|&i| seen[i].load(Ordering::Relaxed) > before[i])
        .unwrap()
}

#[tokio::test]
async fn maglev_sends_a_key_to_its_pe_on_every_proxy_and_back_after_an_ejection() {
    hashing_keeps_keys(crate::config::Select::Maglev).await;
}

#[tokio::test]
async fn ring_hash_sends_a_key_to_its_pe_on_every_proxy_and_back_after_an_ejection() {
    hashing_keeps_keys(crate::config::Select::RingHash).await;
}

async fn hashing_keeps_keys(select: crate::config::Select) {
    let (pes, seen) = answering(4).await;
    let maglev = || crate::config::PoolConfig {
        select,
        hash_key: "header:x-user".parse().unwrap(),
        ..Default::default()
    };
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(maglev(), None);
    // A second proxy with the same pool.
    let (ctx2, pool2, _) = self::ctx(&pes, ProxyConfig::default());
    pool2.set_config(maglev(), None);
    let users = [
        "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi",
    ];
    let mut home = Vec::new();
    for u in users {
        let first = served_by(&ctx, &pool, &seen, u).await;
        for _ in 0..3 {
            assert_eq!(served_by(&ctx, &pool, &seen, u).await, first, "{u} stays");
        }
        assert_eq!(
            served_by(&ctx2, &pool2, &seen, u).await,
            first,
            "{u} on the other proxy"
        );
        home.push(first);
    }
    let mut spread = home.clone();
    spread.sort_unstable();
    spread.dedup();
    assert!(spread.len() >= 2, "keys spread over the PEs: {home:?}");
    // Alice's PE ejected: she is served by another, the others stay where they were.
    let alice = home[0];
    let b = pe_stats(&pool, alice as u32 + 1);
    assert!(b.failed(&ctx.pools.settings.health, true));
    let elsewhere = served_by(&ctx, &pool, &seen, "alice").await;
    assert_ne!(elsewhere, alice);
    for (u, &h) in users.iter().zip(&home) {
        if h != alice {
            assert_eq!(served_by(&ctx, &pool, &seen, u).await, h, "{u} unmoved");
        }
    }
    // Back: so is Alice.
    b.succeeded();
    assert_eq!(served_by(&ctx, &pool, &seen, "alice").await, alice);
}

#[tokio::test]
async fn a_pe_that_joins_takes_its_share_slowly_with_slow_start() {
    let (a, a_seen) = pe(Pe::Answers).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let local = |slow_start_ms| crate::config::PoolConfig {
        select: crate::config::Select::LeastConnections,
        slow_start_ms,
        ..Default::default()
    };
    for slow_start_ms in [0, 2_000] {
        let (ctx, pool, _) = ctx(&[a], ProxyConfig::default());
        pool.set_config(local(slow_start_ms), None);
        for _ in 0..20 {
            one(&ctx, &pool, GET, "").await;
        }
        tokio::time::sleep(Duration::from_millis(slow_start_ms)).await;
        // B joins: least connections would give it every request until it caught up.
        pool.update(elements(&[a, b]));
        let (a0, b0) = (
            a_seen.load(Ordering::Relaxed),
            b_seen.load(Ordering::Relaxed),
        );
        for _ in 0..40 {
            one(&ctx, &pool, GET, "").await;
        }
        let to_b = b_seen.load(Ordering::Relaxed) - b0;
        let to_a = a_seen.load(Ordering::Relaxed) - a0;
        assert_eq!(to_a + to_b, 40);
        if slow_start_ms == 0 {
            // Without slow start the new PE takes every request until it caught up (20).
            assert!(to_b >= 25, "{to_b}");
        } else {
            assert!(
                to_b <= 10,
                "slow start: the new PE took {to_b} of 40 at once"
            );
            // After its ramp it takes its full share (and catches up).
            tokio::time::sleep(Duration::from_millis(slow_start_ms)).await;
            let b1 = b_seen.load(Ordering::Relaxed);
            for _ in 0..20 {
                one(&ctx, &pool, GET, "").await;
            }
            assert!(b_seen.load(Ordering::Relaxed) - b1 >= 15);
        }
    }
}

#[tokio::test]
async fn the_circuit_breaker_answers_503_at_once_beyond_max_requests() {
    let (a, _) = pe(Pe::Silent).await;
    let cfg = ProxyConfig {
        request_timeout_ms: 2_000,
        ..ProxyConfig::default()
    };
    let (ctx, pool, _) = ctx(&[a], cfg);
    pool.set_config(
        crate::config::PoolConfig {
            max_requests: Some(1),
            ..Default::default()
        },
        None,
    );
    let held = {
        let (ctx, pool) = (ctx.clone(), pool.clone());
        tokio::spawn(async move { one(&ctx, &pool, GET, "").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("Retry-After"), "{got}");
    assert!(started.elapsed() < Duration::from_millis(500), "at once");
    assert_eq!(pool.circuit_refused(), 1);
    // The held one ends with the PE's timeout; then there is room again.
    let (_, got) = held.await.unwrap();
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
}

#[tokio::test]
async fn a_pe_that_answers_5xx_in_a_row_is_ejected() {
    let (a, a_seen) = pe(Pe::Errors).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    // The least used PE answers 500: its answers go to the client (it answered), five in a row
    // eject it.
    for _ in 0..5 {
        let (keep, got) = one(&ctx, &pool, GET, "").await;
        assert!(got.starts_with("HTTP/1.1 500"), "{got}");
        assert!(keep);
    }
    assert_eq!(
        pe_stats(&pool, 1).stats.ejections.load(Ordering::Relaxed),
        1
    );
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(a_seen.load(Ordering::Relaxed), 5);
    assert_eq!(b_seen.load(Ordering::Relaxed), 1);
    assert!(
        reported(&mut reports).is_empty(),
        "it answers: not unreachable"
    );
}

#[tokio::test]
async fn a_pe_whose_success_rate_lies_below_the_pools_is_ejected() {
    let (a, _) = pe(Pe::Flaky).await;
    let (b, _) = pe(Pe::Answers).await;
    let (c, _) = pe(Pe::Answers).await;
    let (ctx, pool, _) = ctx(&[a, b, c], ProxyConfig::default());
    // Three PEs: one lying a standard deviation below the mean is as far out as it gets.
    pool.set_config(
        crate::config::PoolConfig {
            select: crate::config::Select::P2c,
            success_rate_interval_ms: 1000,
            success_rate_min_requests: 10,
            success_rate_min_hosts: 3,
            success_rate_stdev_factor: 1.0,
            ..Default::default()
        },
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let flaky = pe_stats(&pool, 1);
    while flaky.stats.ejections.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "never ejected");
        one(&ctx, &pool, GET, "").await;
    }
    let by = |c: crate::balance::outlier::EjectCause| {
        flaky.stats.ejections_by[c.index()].load(Ordering::Relaxed)
    };
    use crate::balance::outlier::EjectCause::*;
    assert_eq!(
        (by(SuccessRate), by(Consecutive5xx), by(Failures)),
        (1, 0, 0)
    );
    for id in [2, 3] {
        assert_eq!(
            pe_stats(&pool, id).stats.ejections.load(Ordering::Relaxed),
            0
        );
    }
    // Ejected: the next requests go to the others.
    let before = flaky.stats.requests.load(Ordering::Relaxed);
    for _ in 0..10 {
        let (_, got) = one(&ctx, &pool, GET, "").await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }
    assert_eq!(flaky.stats.requests.load(Ordering::Relaxed), before);
}

#[tokio::test]
async fn a_pe_slower_than_the_try_timeout_is_busy_and_the_request_goes_elsewhere() {
    let (a, a_seen) = pe(Pe::Silent).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let cfg = ProxyConfig {
        request_timeout_ms: 5_000,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a, b], cfg);
    pool.set_config(
        crate::config::PoolConfig {
            try_timeout_ms: 200,
            ..Default::default()
        },
        None,
    );
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_millis(2_000),
        "{took:?}"
    );
    assert_eq!(
        (
            a_seen.load(Ordering::Relaxed),
            b_seen.load(Ordering::Relaxed)
        ),
        (1, 1)
    );
    let slow = pe_stats(&pool, 1);
    assert_eq!(slow.stats.busy.load(Ordering::Relaxed), 1);
    assert_eq!(slow.stats.ejections.load(Ordering::Relaxed), 0);
    assert!(reported(&mut reports).is_empty(), "slow is not unreachable");

    // A request that must not go twice gets the try's timeout as its answer.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, POST, "hi").await;
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
    assert!(started.elapsed() < Duration::from_millis(2_000));
    assert_eq!(a_seen.load(Ordering::Relaxed), 2);
    assert_eq!(b_seen.load(Ordering::Relaxed), 1, "not sent twice");
}

#[tokio::test]
async fn a_sticky_cookie_brings_a_client_back_to_its_pe_also_after_the_pe_restarts() {
    let (pes, seen) = answering(3).await;
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(
        crate::config::PoolConfig {
            select: crate::config::Select::P2c,
            sticky_cookie: Some("SRV".into()),
            ..Default::default()
        },
        None,
    );
    // Which PE (0-based) served, and the cookie the proxy set, if it set one.
    let ask = |cookie: Option<String>| {
        let (ctx, pool, seen) = (&ctx, &pool, &seen);
        async move {
            let before: Vec<usize> = seen.iter().map(|s| s.load(Ordering::Relaxed)).collect();
            let text = match cookie {
                Some(c) => format!("GET / HTTP/1.1\r\nHost: x\r\nCookie: a=b; SRV={c}\r\n\r\n"),
                None => GET.to_string(),
            };
            let (_, got) = one(ctx, pool, &text, "").await;
            assert!(got.starts_with("HTTP/1.1 200"), "{got}");
            let by = (0..seen.len())
                .find(|&i| seen[i].load(Ordering::Relaxed) > before[i])
                .unwrap();
            let set = got
                .lines()
                .find_map(|l| l.strip_prefix("Set-Cookie: SRV="))
                .map(|v| v.split(';').next().unwrap().to_string());
            (by, set)
        }
    };
    let (first, set) = ask(None).await;
    let cookie = set.expect("the proxy sets its cookie");
    assert_eq!(cookie, format!("{:08x}", first + 1));
    for _ in 0..10 {
        assert_eq!(
            ask(Some(cookie.clone())).await,
            (first, None),
            "back to its PE"
        );
    }
    // Its PE restarts elsewhere under the same identifier: the cookie still finds it.
    let (moved, moved_seen) = pe(Pe::Answers).await;
    let mut list = super::testbed::elements(&pes);
    list[first] = super::testbed::elements(&[moved]).remove(0);
    list[first].id = first as u32 + 1;
    pool.update(list);
    let before = moved_seen.load(Ordering::Relaxed);
    let text = format!("GET / HTTP/1.1\r\nHost: x\r\nCookie: SRV={cookie}\r\n\r\n");
    let (_, got) = one(&ctx, &pool, &text, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(!got.contains("Set-Cookie"), "{got}");
    assert_eq!(moved_seen.load(Ordering::Relaxed), before + 1);
    // Ejected: another PE serves, and the cookie moves to it.
    assert!(pe_stats(&pool, first as u32 + 1).failed(&ctx.pools.settings.health, true));
    let (other, set) = ask(Some(cookie.clone())).await;
    assert_ne!(other, first);
    assert_eq!(set, Some(format!("{:08x}", other + 1)));
}

#[tokio::test]
async fn no_request_goes_out_again_once_response_bytes_reached_the_client() {
    let (a, a_seen) = pe(Pe::Breaks).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, _) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    // The client has the head and part of the body; the connection ends there.
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.ends_with("partial"), "{got}");
    assert!(!keep);
    assert_eq!(a_seen.load(Ordering::Relaxed), 1);
    assert_eq!(b_seen.load(Ordering::Relaxed), 0, "never a second attempt");
    assert_eq!(pool.retries_refused(), 0, "not even asked for");
}
