//! The Redis store's metric families (`tollgate_store_*`), written at scrape time from
//! its report: calls, errors, timeouts, breaker rejections and changes, breaker state,
//! connection and serving state and latency per node; replica fallbacks and
//! writability per shard; with `on_error = "local"`, whether each shard is enforced
//! locally. Nodes that come and go (Sentinel replicas, a reload's new
//! store) need no registration.

use super::RedisStore;
use crate::limiter::store::status::NodeReport;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// The labels of one row.
type Labels = Vec<(&'static str, String)>;

/// One counter family named `name`, a row per `(labels, value)`.
fn counter_family(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> std::fmt::Result {
    let mut me = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

/// One gauge family named `name`, a row per `(labels, value)`.
fn gauge_family(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, i64)],
) -> std::fmt::Result {
    let mut me = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

/// The labels of a node's rows: its shard's index, its role and its address.
fn node_labels(shard: usize, n: &NodeReport) -> Labels {
    vec![
        ("shard", shard.to_string()),
        ("role", n.role.to_string()),
        ("node", n.addr.clone()),
    ]
}

impl RedisStore {
    /// Write the store's metric families into `enc` (see the module documentation);
    /// nothing before the store has started. Errors: only `enc`'s.
    pub fn encode_metrics(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let report = self.report();
        if report.is_empty() {
            return Ok(());
        }
        let mut calls = Vec::new();
        let mut errors = Vec::new();
        let mut timeouts = Vec::new();
        let mut fast_fails = Vec::new();
        let mut changes = Vec::new();
        let mut state = Vec::new();
        let mut up = Vec::new();
        let mut serving = Vec::new();
        let mut fallbacks = Vec::new();
        let mut writable = Vec::new();
        for shard in &report {
            fallbacks.push((
                vec![("shard", shard.index.to_string())],
                shard.replica_fallbacks,
            ));
            writable.push((
                vec![("shard", shard.index.to_string())],
                i64::from(shard.writable),
            ));
            for n in &shard.nodes {
                let l = node_labels(shard.index, n);
                calls.push((l.clone(), n.counts.calls));
                errors.push((l.clone(), n.counts.errors));
                timeouts.push((l.clone(), n.counts.timeouts));
                fast_fails.push((l.clone(), n.counts.rejected_by_breaker));
                changes.push((l.clone(), n.counts.breaker_changes));
                state.push((l.clone(), n.breaker.gauge()));
                serving.push((l.clone(), i64::from(n.serving)));
                up.push((l, i64::from(n.connected)));
            }
        }
        counter_family(enc, "store_calls", "Store calls per Redis node", &calls)?;
        counter_family(
            enc,
            "store_errors",
            "Store calls that failed with an error",
            &errors,
        )?;
        counter_family(
            enc,
            "store_timeouts",
            "Store calls that exceeded store.timeout",
            &timeouts,
        )?;
        counter_family(
            enc,
            "store_breaker_rejections",
            "Store calls refused by an open breaker",
            &fast_fails,
        )?;
        counter_family(
            enc,
            "store_breaker_changes",
            "Circuit breaker state changes",
            &changes,
        )?;
        counter_family(
            enc,
            "store_replica_fallbacks",
            "Checks meant for a replica answered by the primary",
            &fallbacks,
        )?;
        gauge_family(
            enc,
            "store_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            &state,
        )?;
        gauge_family(
            enc,
            "store_connected",
            "1 when the node has a live connection",
            &up,
        )?;
        gauge_family(
            enc,
            "store_serving",
            "0 while the node answers LOADING or MASTERDOWN (a replica is then skipped for reads)",
            &serving,
        )?;
        gauge_family(
            enc,
            "store_shard_writable",
            "0 while writes to the shard's primary fail (its checks then follow store.on_error)",
            &writable,
        )?;
        let local = self.fallback_actives();
        if !local.is_empty() {
            let rows: Vec<(Labels, i64)> = local
                .iter()
                .enumerate()
                .map(|(i, &on)| (vec![("shard", i.to_string())], i64::from(on)))
                .collect();
            gauge_family(
                enc,
                "store_fallback_active",
                "1 while the shard's limits are enforced in this gateway's memory (store.on_error = \"local\")",
                &rows,
            )?;
        }
        let mut me = enc.encode_descriptor(
            "store_latency_seconds",
            "Store call latency per Redis node",
            None,
            MetricType::Histogram,
        )?;
        for shard in &report {
            for n in &shard.nodes {
                n.latency
                    .encode(me.encode_family(&node_labels(shard.index, n))?)?;
            }
        }
        Ok(())
    }
}
