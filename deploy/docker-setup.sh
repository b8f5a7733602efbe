#!/bin/sh
# Sets up a Debian bookworm host (root) for the CPU profile of docker-compose.yml:
# Docker Engine (Debian's docker.io), debootstrap (deploy/image.sh's base when Docker
# Hub is unreachable), gVisor's runsc registered as the `runsc` runtime (for containers of
# your own: the compose files no longer use it, the reward container starts runsc itself), the
# Compose v2 plugin, and a running dockerd. Each step is skipped when already done.
#
# Compose v2: bookworm's `docker-compose` package is Compose v1 (1.29, Python, no
# `docker compose`, no `!reset`), so the plugin comes from Debian trixie's package
# (2.26.1, one static binary; depends only on libc6 >= 2.34), fetched through apt with a
# private source list that leaves this host's apt configuration alone.
set -eu

STATE=${DOCKER_SETUP_STATE:-/var/lib/tandem-docker-setup}
LOG=${DOCKER_SETUP_LOG:-$STATE/dockerd.log}
mkdir -p "$STATE"

need=""
command -v dockerd >/dev/null || need="$need docker.io"
command -v debootstrap >/dev/null || need="$need debootstrap"
command -v runsc >/dev/null || need="$need runsc"
if [ -n "$need" ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $need
fi

if ! docker compose version >/dev/null 2>&1; then
    apt_dir="$STATE/apt-trixie"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
    set -- -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    apt-get "$@" update -q
    (cd "$apt_dir" && apt-get "$@" download docker-compose=2.26.1-4)
    dpkg -i "$apt_dir"/docker-compose_2.26.1-4_amd64.deb
fi

# runsc as a Docker runtime. --network=host: gVisor uses the network namespace Docker
# created for the container (its own netstack refuses to start here under Docker 20.10).
config=/etc/docker/daemon.json
if ! grep -q '"runsc"' "$config" 2>/dev/null; then
    [ ! -s "$config" ] || { echo "$config exists: add the runsc runtime to it by hand" >&2; exit 1; }
    mkdir -p /etc/docker
    printf '%s\n' '{' '  "runtimes": {' \
        "    \"runsc\": {\"path\": \"$(command -v runsc)\", \"runtimeArgs\": [\"--network=host\"]}" \
        '  }' '}' > "$config"
    ! docker info >/dev/null 2>&1 || kill -HUP "$(pidof dockerd)"  # a running daemon reloads its runtimes
fi

if ! docker info >/dev/null 2>&1; then
    # no init system here (containers, CI): start the daemon ourselves, detached from this shell
    setsid dockerd >"$LOG" 2>&1 </dev/null &
    echo $! > "$STATE/dockerd.pid"
    i=0
    until docker info >/dev/null 2>&1; do
        i=$((i + 1))
        [ "$i" -le 60 ] || { echo "dockerd did not start; see $LOG" >&2; exit 1; }
        sleep 1
    done
fi
docker info --format '{{.ServerVersion}} runtimes: {{range $k, $v := .Runtimes}}{{$k}} {{end}}'
