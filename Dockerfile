# syntax=docker/dockerfile:1
#
# tollgate container image.
#
#   docker build -t tollgate .
#   docker run -d --name tollgate -p 8080:8080 -p 9901:9901 --stop-timeout 45 \
#     -v /srv/tollgate:/etc/tollgate:ro tollgate
#
# The config is mounted at /etc/tollgate/tollgate.toml (mount the directory, not the
# file: editors and ConfigMaps replace the file, which a single-file bind mount would not
# follow). Inside a container it must listen on all interfaces, or nothing outside the
# container can reach it, and it needs the admin listener for the HEALTHCHECK:
#
#   [server]
#   listen = "0.0.0.0:8080"
#   admin_listen = "0.0.0.0:9901"
#
# Reload: `docker kill --signal=HUP tollgate` (or edit the file: server.watch_config is
# on by default). Stop: SIGTERM drains in-flight requests for up to server.shutdown_grace
# (default 30s), so give `docker stop` more than that (--stop-timeout 45 above; Docker's
# default is 10s). See docs/operations.md.

# ---- build ---------------------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the crate downloads and the compiled dependencies between builds,
# so a change to tollgate's own sources recompiles only tollgate. The binary is copied
# out of the cached target directory, which is not part of the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tollgate \
 && install -m 0755 target/release/tollgate /usr/local/bin/tollgate

# ---- runtime -------------------------------------------------------------------------
# debian:bookworm-slim rather than distroless: the same Debian release (and glibc) as the
# build stage, and a shell for `docker exec` when debugging. tollgate needs nothing else
# at run time: the HEALTHCHECK is the binary itself (no curl), and `https://` upstreams
# trust Mozilla's roots built into the binary (`tls_roots = "webpki"`, the default) or a
# mounted `ca` file, so no ca-certificates (install it for `tls_roots = "system"`). gcr.io/distroless/cc-debian12:nonroot works as a drop-in with
# `USER 10001:10001` if a smaller image matters more than a shell.
FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 tollgate \
 && useradd --system --uid 10001 --gid tollgate --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin tollgate
COPY --from=build /usr/local/bin/tollgate /usr/local/bin/tollgate
USER 10001:10001

# 8080: the proxy (server.listen). 9901: /healthz, /readyz, /metrics, /config
# (server.admin_listen); do not publish it to the internet.
EXPOSE 8080 9901
STOPSIGNAL SIGTERM
# GET /healthz on server.admin_listen, read from the config; fails when admin_listen is unset.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/tollgate", "healthcheck", "--config", "/etc/tollgate/tollgate.toml"]
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["run", "--config", "/etc/tollgate/tollgate.toml"]
