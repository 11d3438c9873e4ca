#!/usr/bin/env bash
# Installs the Debian packages ccalloc's build, tools and tests need, if any is
# missing. The core library itself needs only the C++ standard library (and
# CUDA for the CUDA backend).
set -euo pipefail
# chromium: the report test renders the HTML report headless (tests/report_render_test.py).
# clang and libclang-rt-dev (the libFuzzer runtime, libclang_rt.fuzzer) build
# the fuzzers; gcc's sanitizer runtimes come with g++.
# python3-venv/-setuptools/-wheel/-pip: the package's offline install test
# (pip install --no-build-isolation . in a fresh venv, tests/python_install_test.sh).
pkgs=(cmake ninja-build g++ zlib1g-dev libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev python3
      python3-pytest python3-venv python3-setuptools python3-wheel python3-pip pkgconf chromium clang libclang-rt-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps.sh: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
