#!/usr/bin/env bash
# packaging/deb.sh: build tollgate's Debian package and check it on this machine (issue 49).
#
#   bash packaging/deb.sh                 release build (`cargo deb`), then the checks
#   bash packaging/deb.sh --binary PATH   package the binary at PATH instead of building
#                                         (CI: the debug binary `cargo test` built; it is
#                                         stripped and compressed fast), then the checks
#   bash packaging/deb.sh --sync-unit     rewrite packaging/deb/tollgate.service from
#                                         systemd/tollgate.service, and do nothing else
#
# The package is left in target/debian/ (or $CARGO_TARGET_DIR/debian/) as
# tollgate_VERSION_ARCH.deb. Installs cargo-deb and lintian when they are missing.
#
# The checks: lintian with no errors; `dpkg -i`; `tollgate check` of the installed config
# as the tollgate user; the installed binary, started as that user on free ports, serving
# a request; an upgrade to a config the new version rejects failing with the check's error
# while the running gateway keeps serving; `systemd-analyze verify` of the installed unit;
# `dpkg -r` keeping the config and `dpkg -P` removing it and the user; then nothing of the
# package left behind. They install and purge the package, so they refuse to run where
# tollgate (the package, its user or /etc/tollgate) is already installed. Root, or sudo.
# Whatever fails, the exit trap stops the gateway and purges the package.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
# The cargo-deb release this script is written against (`--locked`: its own Cargo.lock).
CARGO_DEB_VERSION=3.8.0
UNIT_SRC=systemd/tollgate.service
UNIT_PKG=packaging/deb/tollgate.service
CONFIG=/etc/tollgate/tollgate.toml

started=$SECONDS
say() { echo "deb: [$((SECONDS - started))s] $*"; }
fail() {
  echo "deb: FAILED: $*" >&2
  exit 1
}
# Run a command, its output indented; on failure, say what failed.
run() {
  local what=$1 rc=0
  shift
  "$@" >"$work/run.out" 2>&1 || rc=$?
  sed 's/^/    /' "$work/run.out"
  [ "$rc" = 0 ] || fail "$what (exit $rc)"
}

# The packaged unit: the header comment of packaging/deb/tollgate.service, then
# systemd/tollgate.service from its [Unit] line on, with the binary at /usr/bin.
packaged_unit() {
  sed '/^\[Unit\]/,$d' "$UNIT_PKG"
  sed -n '/^\[Unit\]/,$p' "$UNIT_SRC" | sed 's|/usr/local/bin/tollgate|/usr/bin/tollgate|g'
}

binary=""
case "${1:-}" in
  "") ;;
  --sync-unit)
    packaged_unit > "$UNIT_PKG.new"
    mv "$UNIT_PKG.new" "$UNIT_PKG"
    echo "deb: wrote $UNIT_PKG"
    exit 0
    ;;
  --binary)
    binary=${2:?--binary needs the path of a tollgate binary}
    [ -x "$binary" ] || fail "$binary is not an executable"
    ;;
  *)
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac

if ! cmp -s <(packaged_unit) "$UNIT_PKG"; then
  diff <(packaged_unit) "$UNIT_PKG" >&2 || true
  fail "$UNIT_PKG is not $UNIT_SRC at /usr/bin: run bash packaging/deb.sh --sync-unit"
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# Refuse to touch a machine where tollgate is installed: the checks end with a purge.
status=$(dpkg-query -W -f='${Status}' tollgate 2>/dev/null || true)
if [ -n "$status" ] && [ "$status" != "unknown ok not-installed" ]; then
  fail "the tollgate package is on this machine ($status); the checks would purge it"
fi
if getent passwd tollgate >/dev/null || getent group tollgate >/dev/null || [ -e /etc/tollgate ]; then
  fail "a tollgate user, group or /etc/tollgate exists here; the checks would remove them"
fi

# The tools: cargo-deb from crates.io (about 70 s to build, without its liblzma: the
# system's xz compresses), lintian and curl from Debian's packages.
if ! cargo deb --version >/dev/null 2>&1; then
  say "installing cargo-deb $CARGO_DEB_VERSION"
  env -u CARGO_TARGET_DIR cargo install cargo-deb --version "$CARGO_DEB_VERSION" \
    --locked --no-default-features --quiet
fi
missing=""
command -v lintian >/dev/null 2>&1 || missing="$missing lintian"
command -v curl >/dev/null 2>&1 || missing="$missing curl"
if [ -n "$missing" ]; then
  say "installing$missing from Debian's packages"
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
say "$(cargo deb --version), $(lintian --version)"

target_dir=${CARGO_TARGET_DIR:-$PWD/target}
out="$target_dir/debian"
mkdir -p "$out"
work=$(mktemp -d)
chmod 0755 "$work" # the gateway, as the tollgate user, reads its config here
gateway_pid=""
installed=0

cleanup() {
  rc=$?
  if [ -n "$gateway_pid" ] && kill -0 "$gateway_pid" 2>/dev/null; then
    kill "$gateway_pid" 2>/dev/null || true
    wait "$gateway_pid" 2>/dev/null || true
  fi
  if [ "$installed" = 1 ]; then
    echo "deb: cleaning up: dpkg -P tollgate" >&2
    [ -f "$work/tollgate.toml.orig" ] && $SUDO cp -p "$work/tollgate.toml.orig" "$CONFIG"
    $SUDO rm -rf /etc/systemd/system/tollgate.service.d
    $SUDO dpkg -P tollgate >/dev/null 2>&1 || echo "deb: dpkg -P tollgate failed; purge it by hand" >&2
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. Build. cargo-deb reads the binary at target/release/tollgate of the target directory
# it is given; for --binary that is a staging directory holding a link to PATH.
if [ -z "$binary" ]; then
  say "cargo deb (a release build: about 4 minutes from scratch)"
  cargo deb --locked --output "$out" >"$work/cargo-deb.out"
else
  say "cargo deb --no-build of $binary (stripped, fast compression)"
  mkdir -p "$work/stage/release"
  ln -s "$(realpath "$binary")" "$work/stage/release/tollgate"
  CARGO_TARGET_DIR="$work/stage" cargo deb --no-build --strip --fast --output "$out" \
    >"$work/cargo-deb.out"
fi
deb=$(tail -n 1 "$work/cargo-deb.out")
[ -f "$deb" ] || fail "cargo deb printed no package path: $(cat "$work/cargo-deb.out")"
version=$(dpkg-deb -f "$deb" Version)
say "built $deb ($(du -k "$deb" | cut -f1) KiB, version $version)"
dpkg-deb -I "$deb" | sed -n '/Package:/,$p' | sed 's/^/    /'

# A second version of the same build, for the upgrade check.
next="$work/next"
mkdir -p "$next"
dpkg-deb -R "$deb" "$next/root"
sed -i "s/^Version: .*/Version: $version+check/" "$next/root/DEBIAN/control"
dpkg-deb --root-owner-group -Znone -b "$next/root" "$next/tollgate_next.deb" >/dev/null

# 2. lintian: no errors (warnings are shown). Overrides, with their reasons, are in
# packaging/deb/lintian-overrides.
say "lintian $(basename "$deb")"
run "lintian reports errors" lintian --fail-on error --display-level '>=warning' "$deb"

# Every path in the package, and whether it existed before the install: after the purge,
# none of those that did not may be left.
dpkg-deb --fsys-tarfile "$deb" | tar -t | sed 's|^\./|/|; s|/$||' | grep -v '^/\?$' >"$work/paths"
: >"$work/new-paths"
while read -r p; do
  [ -e "$p" ] || [ -L "$p" ] || echo "$p" >>"$work/new-paths"
done <"$work/paths"

# 3. Install.
say "dpkg -i $(basename "$deb")"
installed=1
run "dpkg -i" $SUDO dpkg -i "$deb"
[ "$(dpkg-query -W -f='${Status} ${Version}' tollgate)" = "install ok installed $version" ] ||
  fail "tollgate $version is not installed: $(dpkg-query -W -f='${Status} ${Version}' tollgate)"
[ -x /usr/bin/tollgate ] || fail "/usr/bin/tollgate is missing"
[ -f /lib/systemd/system/tollgate.service ] || fail "/lib/systemd/system/tollgate.service is missing"
getent passwd tollgate >/dev/null || fail "no tollgate user"
perms=$(stat -c '%U:%G %a' "$CONFIG")
[ "$perms" = "root:tollgate 640" ] || fail "$CONFIG is $perms, not root:tollgate 640"
perms=$(stat -c '%U:%G %a' /etc/tollgate)
[ "$perms" = "root:tollgate 750" ] || fail "/etc/tollgate is $perms, not root:tollgate 750"
grep -qx "$CONFIG" <(dpkg-query --showformat='${Conffiles}\n' --show tollgate | awk '{print $1}') ||
  fail "$CONFIG is not a conffile"
for doc in README.md docs/operations.md docs/configuration.md grafana/tollgate.json prometheus/alerts.yml; do
  [ -f "/usr/share/doc/tollgate/$doc" ] || fail "/usr/share/doc/tollgate/$doc is missing"
done
if [ -d /run/systemd/system ]; then
  say "systemd runs here: the postinst enabled and started tollgate.service"
  systemctl is-active --quiet tollgate || fail "tollgate.service is not active"
else
  say "systemd does not run here (PID 1 is $(ps -o comm= -p 1)): the service was left alone"
fi

# 4. The config check as the service user.
as_tollgate() {
  if command -v sudo >/dev/null 2>&1; then
    sudo -u tollgate -- "$@"
  else
    $SUDO runuser -u tollgate -- "$@"
  fi
}
say "tollgate check --config $CONFIG, as the tollgate user"
run "tollgate check as the tollgate user" as_tollgate tollgate check --config "$CONFIG"

# 5. The installed binary serves, as the tollgate user, on free ports: the installed
# config with its listeners moved there, and its upstream pointed at the gateway's own
# admin listener, so a request through the proxy comes back from /healthz.
free_port() {
  local p
  for _ in $(seq 1 100); do
    p=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  return 1
}
listen=$(free_port)
admin=$(free_port)
while [ "$admin" = "$listen" ]; do admin=$(free_port); done
$SUDO cat "$CONFIG" |
  sed -e "s|^listen = \"127.0.0.1:8080\"|listen = \"127.0.0.1:$listen\"|" \
    -e "s|^admin_listen = \"127.0.0.1:9901\"|admin_listen = \"127.0.0.1:$admin\"|" \
    -e "s|^targets = \\[\"http://127.0.0.1:9000\"\\]|targets = [\"http://127.0.0.1:$admin\"]|" \
    >"$work/gateway.toml"
chmod 0644 "$work/gateway.toml"
if ! grep -q "127.0.0.1:$listen" "$work/gateway.toml" || ! grep -q "http://127.0.0.1:$admin" "$work/gateway.toml"; then
  fail "config/tollgate.toml's listen, admin_listen or targets lines changed; update this script"
fi
say "starting /usr/bin/tollgate as the tollgate user (proxy 127.0.0.1:$listen, admin 127.0.0.1:$admin)"
$SUDO setpriv --reuid=tollgate --regid=tollgate --init-groups \
  /usr/bin/tollgate run --config "$work/gateway.toml" >"$work/gateway.log" 2>&1 &
gateway_pid=$!
for _ in $(seq 1 100); do
  curl -fsS -o /dev/null "http://127.0.0.1:$admin/healthz" 2>/dev/null && break
  kill -0 "$gateway_pid" 2>/dev/null || { cat "$work/gateway.log" >&2; fail "the gateway exited"; }
  sleep 0.1
done
[ "$(ps -o user= -p "$gateway_pid")" = tollgate ] || fail "the gateway does not run as tollgate"
code=$(curl -sS -D "$work/headers" -o "$work/body" -w '%{http_code}' "http://127.0.0.1:$listen/healthz")
say "GET http://127.0.0.1:$listen/healthz through the proxy: $code $(cat "$work/body")"
grep -i '^x-ratelimit-' "$work/headers" | tr -d '\r' | sed 's/^/    /'
[ "$code" = 200 ] || { cat "$work/gateway.log" >&2; fail "the proxied request got $code, not 200"; }
grep -q '"status":"ok"' "$work/body" || fail "the proxied request's body is not the upstream's"
grep -qi '^x-ratelimit-limit: 60' "$work/headers" || fail "no X-RateLimit-Limit: 60 (core's anonymous quota)"
grep -qi '^x-ratelimit-remaining: 59' "$work/headers" || fail "no X-RateLimit-Remaining: 59"

# 6. An upgrade to a config the new version rejects stops in the postinst with the check's
# error, before any restart: the package is half-configured, the running gateway serves
# on. With the config fixed, `dpkg --configure` finishes the upgrade.
say "upgrade to $version+check with a config it rejects"
$SUDO cp -p "$CONFIG" "$work/tollgate.toml.orig"
$SUDO sed -i 's/^algorithm = "fixed_window"/algorithm = "fixed_windw"/' "$CONFIG"
if $SUDO dpkg -i "$next/tollgate_next.deb" >"$work/upgrade.log" 2>&1; then
  cat "$work/upgrade.log" >&2
  fail "the upgrade went through with a rejected config"
fi
sed 's/^/    /' "$work/upgrade.log"
grep -Eq "^$CONFIG:[0-9]+:[0-9]+: limits\[0\]\.algorithm: " "$work/upgrade.log" ||
  fail "dpkg's output lacks the check's error ($CONFIG:LINE:COLUMN: limits[0].algorithm: ...)"
[ "$(dpkg-query -W -f='${Status}' tollgate)" = "install ok half-configured" ] ||
  fail "after the failed upgrade tollgate is $(dpkg-query -W -f='${Status}' tollgate)"
kill -0 "$gateway_pid" 2>/dev/null || fail "the running gateway died in the failed upgrade"
code=$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$listen/healthz")
[ "$code" = 200 ] || fail "after the failed upgrade the gateway answers $code"
say "the upgrade failed with the check's error; the running gateway still answers 200"
# The fixed config reads store.hash_key_file = "hash-key", a systemd credential of a
# drop-in (LoadCredential=, from a root-only file): the postinst's check must find it in
# $CREDENTIALS_DIRECTORY as the service would, or it fails.
dropin=/etc/systemd/system/tollgate.service.d
printf '%s\n' "a-hash-key-for-the-check" >"$work/hash-key"
chmod 0600 "$work/hash-key"
$SUDO mkdir -p "$dropin"
printf '[Service]\nLoadCredential=hash-key:%s\n' "$work/hash-key" | $SUDO tee "$dropin/check.conf" >/dev/null
$SUDO cp -p "$work/tollgate.toml.orig" "$CONFIG"
$SUDO sed -i 's/^key_prefix = "tollgate:"$/&\nhash_key_file = "hash-key"/' "$CONFIG"
$SUDO grep -q '^hash_key_file = "hash-key"$' "$CONFIG" || fail "could not add hash_key_file to $CONFIG"
run "dpkg --configure tollgate with the config fixed" $SUDO dpkg --configure tollgate
$SUDO rm -r "$dropin"
$SUDO cp -p "$work/tollgate.toml.orig" "$CONFIG"
[ "$(dpkg-query -W -f='${Status} ${Version}' tollgate)" = "install ok installed $version+check" ] ||
  fail "after dpkg --configure tollgate is $(dpkg-query -W -f='${Status} ${Version}' tollgate)"
perms=$(stat -c '%U:%G %a' "$CONFIG")
[ "$perms" = "root:tollgate 640" ] || fail "after the upgrade $CONFIG is $perms"
say "config fixed (its hash key a LoadCredential= of a drop-in): dpkg --configure finished the upgrade to $version+check"

# 7. The installed unit.
say "systemd-analyze verify /lib/systemd/system/tollgate.service"
verify=$(systemd-analyze verify /lib/systemd/system/tollgate.service 2>&1) && rc=0 || rc=$?
if [ "$rc" != 0 ] || [ -n "$verify" ]; then
  echo "$verify" >&2
  fail "systemd-analyze verify of the installed unit"
fi

kill "$gateway_pid"
wait "$gateway_pid" 2>/dev/null || true
gateway_pid=""

# 8. Remove: the program goes, the config (and the user) stay.
say "dpkg -r tollgate"
run "dpkg -r" $SUDO dpkg -r tollgate
[ "$(dpkg-query -W -f='${Status}' tollgate)" = "deinstall ok config-files" ] || fail "dpkg -r left $(dpkg-query -W -f='${Status}' tollgate)"
[ ! -e /usr/bin/tollgate ] || fail "dpkg -r left /usr/bin/tollgate"
[ ! -e /lib/systemd/system/tollgate.service ] || fail "dpkg -r left the unit"
[ -f "$CONFIG" ] || fail "dpkg -r removed $CONFIG"
$SUDO cmp -s "$CONFIG" "$work/tollgate.toml.orig" || fail "dpkg -r changed $CONFIG"
perms=$(stat -c '%U:%G %a' "$CONFIG")
[ "$perms" = "root:tollgate 640" ] || fail "after dpkg -r $CONFIG is $perms"

# 9. Purge: the config, /etc/tollgate and the user go too.
say "dpkg -P tollgate"
run "dpkg -P" $SUDO dpkg -P tollgate
installed=0
status=$(dpkg-query -W -f='${Status}' tollgate 2>/dev/null || true)
[ -z "$status" ] || [ "$status" = "unknown ok not-installed" ] || fail "dpkg -P left tollgate $status"

# 10. Nothing left behind.
left=""
while read -r p; do
  if [ -e "$p" ] || [ -L "$p" ]; then left="$left $p"; fi
done <"$work/new-paths"
[ ! -e /etc/tollgate ] || left="$left /etc/tollgate"
getent passwd tollgate >/dev/null && left="$left user:tollgate"
getent group tollgate >/dev/null && left="$left group:tollgate"
for d in /etc/systemd/system /var/lib/systemd/deb-systemd-helper-enabled /var/lib/systemd/deb-systemd-helper-masked; do
  [ -d "$d" ] || continue
  while read -r f; do left="$left $f"; done < <(find "$d" -name '*tollgate*')
done
for f in /var/lib/dpkg/info/tollgate.*; do [ -e "$f" ] && left="$left $f"; done
dpkg-statoverride --list | grep -q tollgate && left="$left statoverride"
[ -z "$left" ] || fail "left behind after dpkg -P:$left"
say "ok: nothing of the package is left; $deb passed every check"
