#!/usr/bin/env bash
# Installs every Debian package that building and testing moeserve needs.
# Idempotent: packages already present are left alone; safe to run again.
# CUDA 13 and NCCL are not installed here: the build uses them when found.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libtbb-dev nlohmann-json3-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libgloo-dev libnuma-dev
  libcli11-dev libcpp-httplib-dev libssl-dev openssl curl
  clang
  python3 python3-numpy python3-grpcio python3-protobuf
  libpcre2-dev libutf8proc-dev libpython3-dev python3-jinja2
)
# Node.js with npm runs the OpenAI client tests; a machine with its own Node.js (which ships npm)
# keeps it.
if ! command -v npm >/dev/null 2>&1; then packages+=(nodejs npm); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
