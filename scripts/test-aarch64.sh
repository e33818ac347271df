#!/usr/bin/env bash
# Cross-compiles the test suite for aarch64 (Apple M1 CPU features: NEON + dot product)
# and runs it under qemu user-mode emulation. Installs what it needs when missing
# (rustup target, the aarch64 cross gcc and qemu-user from apt).
#
#   scripts/test-aarch64.sh                      # kernel tests (lib, kernels, qdot_dispatch,
#                                                # kquant_dispatch, float_dispatch, kv_cache)
#   scripts/test-aarch64.sh --test golden_tiny   # any `cargo test` selection instead
#   scripts/test-aarch64.sh --tools-only         # install the cross tools, then exit (CI)
#
# Tests that start the CLI binary start it through the same qemu runner
# (tests/common/mod.rs `cli()` reads CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

install_tools() {
    if ! rustup target list --installed | grep -qx "$TARGET"; then
        rustup target add "$TARGET" || return 1
    fi
    if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq || return 1
        $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null || return 1
    fi
}

# With TINYGPT_AARCH64_OPTIONAL=1 (CI), a machine that cannot install the cross tools (no
# rustup channel or apt mirror reachable) skips this step with a message instead of failing;
# once the tools are there, a failing test still fails.
if ! install_tools; then
    if [ "${TINYGPT_AARCH64_OPTIONAL:-0}" = 1 ]; then
        echo "aarch64 tests SKIPPED: could not install the $TARGET rustup target, aarch64-linux-gnu-gcc or qemu-user" >&2
        exit 0
    fi
    echo "error: could not install the $TARGET rustup target, aarch64-linux-gnu-gcc or qemu-user" >&2
    exit 1
fi

if [ "${1:-}" = --tools-only ]; then
    exit 0
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
# Overrides .cargo/config.toml's target-cpu=native (the host's CPU, not the target's).
export RUSTFLAGS="-C target-cpu=apple-m1"

if [ "$#" -eq 0 ]; then
    set -- --lib --test kernels --test qdot_dispatch --test kquant_dispatch --test float_dispatch \
        --test kv_cache
fi
cargo test --release --target "$TARGET" "$@"
