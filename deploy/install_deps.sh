#!/usr/bin/env bash
# Installs every build, run and test dependency of pdserve from Debian's registry.
# Idempotent: when every package is already present it returns at once without
# touching apt. Non-interactive. Needs root (or passwordless sudo) only when
# something is actually missing.
#   --build   only what building needs (and the unit suite), under names Debian 12 and
#             Ubuntu 24.04 share: the images' build stages (deploy/Dockerfile*) use this.
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # `sh install_deps.sh` (dash) re-runs under bash
set -euo pipefail
BUILD_PKGS=(
  meson ninja-build pkg-config gcc g++ libc6-dev
  libuv1-dev libjansson-dev node-llhttp
  libgrpc-dev protobuf-c-compiler libprotobuf-c-dev libssl-dev zlib1g-dev
  libopenblas-dev
)
# The tests' references and tools; docker.io, debootstrap, iptables and iproute2 run the
# deployment tests (tests/deploy: images, hosts in network namespaces).
TEST_PKGS=(
  python3 python3-numpy python3-jinja2 python3-yaml python3-jsonschema
  curl wrk valgrind clang libclang-rt-14-dev shellcheck
  nodejs npm
  docker.io debootstrap iptables iproute2
)
case "${1:-}" in
  -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --build) PKGS=("${BUILD_PKGS[@]}") ;;
  "") PKGS=("${BUILD_PKGS[@]}" "${TEST_PKGS[@]}") ;;
  *) echo "install_deps: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

missing=()
for p in "${PKGS[@]}"; do
  # dpkg-query prints "install ok installed" only for fully installed packages.
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    # npm and nodejs may come from outside Debian (e.g. nodesource, nvm): accept a working binary.
    case "$p" in
      nodejs) command -v node >/dev/null 2>&1 && continue ;;
      npm) command -v npm >/dev/null 2>&1 && continue ;;
      # Docker from Docker's own packages (docker-ce, containerd.io) conflicts with docker.io:
      # a daemon already installed is used as it is.
      docker.io) command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1 && continue ;;
    esac
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PKGS[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install_deps: these packages are missing: ${missing[*]}" >&2
    echo "install_deps: run this script as root (or with passwordless sudo) to install them" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install_deps: done"
