#!/bin/sh
# Builds the images of docker-compose.yml's CPU profile (docker-compose.cpu.yml) where
# Docker Hub may be unreachable and containers may not trust the package index's
# certificate (a proxy's CA that only the host holds):
#
#   tandem/debian:bookworm  `debootstrap --variant=minbase bookworm` + `docker import`, only
#                           when the public python:3.11-slim cannot be pulled;
#   tandem/redis:bookworm   Debian's redis-server (7.0) on the Debian base;
#   tandem:cpu              deploy/Dockerfile with EXTRAS=cpu,learner,reward,report, installed
#                           with --no-index from deploy/wheelhouse/, which the host's pip fills
#                           (pip wheel, with the host's certificates and the same pins as the
#                           project's .venv): no certificate or index credential enters an image.
#
# Usage: deploy/image.sh   (run from the repository root; `make image` does)
# Environment: PYTHON (the host's Python 3.11 whose pip fills the wheelhouse; default .venv/bin/python),
# PIP_WHEEL_ARGS (extra pip arguments, e.g. the Makefile's TORCH_INDEX), TANDEM_IMAGE, REDIS_IMAGE.
set -eu

PYTHON=${PYTHON:-.venv/bin/python}
TANDEM_IMAGE=${TANDEM_IMAGE:-tandem:cpu}
REDIS_IMAGE=${REDIS_IMAGE:-tandem/redis:bookworm}
DEBIAN_IMAGE=tandem/debian:bookworm
EXTRAS=cpu,learner,reward,report
WHEELHOUSE=deploy/wheelhouse

log() { echo "image.sh: $*" >&2; }

# the base: the public image when it can be pulled, else Debian bookworm built here
if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
    debian=debian:bookworm-slim
    docker image inspect "$debian" >/dev/null 2>&1 || docker pull -q "$debian" >/dev/null
else
    base=$DEBIAN_IMAGE
    debian=$DEBIAN_IMAGE
    if ! docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then
        log "python:3.11-slim cannot be pulled: building $DEBIAN_IMAGE with debootstrap"
        rootfs=$(mktemp -d /tmp/tandem-rootfs.XXXXXX)
        trap 'rm -rf "$rootfs"' EXIT
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -c . | docker import -c 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
    fi
fi

log "building $REDIS_IMAGE from $debian"
docker build -q --build-arg BASE="$debian" -t "$REDIS_IMAGE" - < deploy/redis.Dockerfile >/dev/null  # no context

log "filling $WHEELHOUSE (pip wheel on the host)"
constraints=$(mktemp /tmp/tandem-constraints.XXXXXX)
# the versions the project's tests ran with (its own editable install left out)
"$PYTHON" -m pip freeze --exclude-editable | grep -v '^tandem' > "$constraints" || true
# shellcheck disable=SC2086  # PIP_WHEEL_ARGS is a list of arguments
"$PYTHON" -m pip wheel -q -w "$WHEELHOUSE" -c "$constraints" ${PIP_WHEEL_ARGS:-} \
    ".[$EXTRAS]" "setuptools>=77" wheel "async-timeout>=4.0.3"  # redis needs it below Python 3.11.3 (bookworm's 3.11.2)
rm -f "$constraints" "$WHEELHOUSE"/tandem_grpo-*.whl  # the image builds tandem from its sources

log "building $TANDEM_IMAGE from $base"
docker build -f deploy/Dockerfile --build-arg BASE="$base" --build-arg EXTRAS="$EXTRAS" \
    --build-arg PIP_ARGS=--no-index -t "$TANDEM_IMAGE" .
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^($TANDEM_IMAGE|$REDIS_IMAGE) "
