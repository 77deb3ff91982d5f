//! The integration tests: one test binary, one module per behaviour, each against real
//! parts started here (the gateway in this process or as the `tollgate` binary, HTTP
//! upstreams, `redis-server` processes; see `support`).
//!
//! Run one module with `cargo test --test it MODULE::` (e.g. `cargo test --test it
//! limits::`). Tests of this binary share one process: a test that changes or measures
//! the whole process (an environment variable, the process's memory) runs in a process of
//! its own through `support::alone_in_process`, and the one tracing subscriber is
//! `support::init_logs`'s.

mod abuse;
mod algorithms;
mod auth_request;
mod authority;
mod block_for;
mod callers;
mod charged_statuses;
mod cli;
mod cluster_failover;
mod conformance;
mod dashboard;
mod docs;
mod edge;
mod failover;
mod harness;
mod headers;
mod jwt;
mod keys;
mod limits;
mod local_fallback;
mod operations;
mod otel;
mod otel_store;
mod packaging;
mod per_address;
mod problem_details;
mod proxy;
mod redis_acl;
mod redis_store;
mod redis_tls;
mod replay;
mod replica_reads;
mod reservation_timeout;
mod reset;
mod resources;
mod round_trips;
mod runtime;
mod settle;
mod store_clock;
mod streaming;
mod support;
mod tls;
mod top;
mod topology;
mod trust;
mod upstreams;
mod websocket;
