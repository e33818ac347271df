#!/bin/sh
# Seeds of the state_decode fuzz target (fuzz/README.md): states saved by
# `tinygpt-cpu sample --save-state` on the bundled model in several cache modes, each
# prefixed with the target's mode byte 1 (reseal the header, so mutations pass the checksum).
# Run from anywhere; uses target/release/tinygpt-cpu (built if missing).
set -eu
cd "$(dirname "$0")/.."
out=fuzz/seeds_state_decode
mkdir -p "$out"
bin=target/release/tinygpt-cpu
[ -x "$bin" ] || cargo build --release
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
seed() {
    name=$1
    shift
    "$bin" sample --prompt "The os module" --tokens 3 --temperature 0 \
        --save-state "$tmp/$name" "$@" >/dev/null 2>&1
    { printf '\001'; cat "$tmp/$name"; } >"$out/$name.state"
}
seed dense_fp32
seed fp16_window --kv-quantize fp16 --streaming-llm-sink 1 --streaming-llm-window 4
seed bf16_pre_rope --kv-quantize bf16 --kv-key-rope pre
seed int4_window_residual --kv-quantize int4 --kv-group-size 2 --kv-residual 2 \
    --streaming-llm-sink 1 --streaming-llm-window 5
seed k8v2_cache_positions --kv-quantize-k int8 --kv-quantize-v int2 --kv-group-size 3 \
    --streaming-llm-sink 2 --streaming-llm-window 4 --streaming-llm-positions cache
seed int2_dense_residual --kv-quantize int2 --kv-group-size 2 --kv-residual 3
ls -l "$out"
