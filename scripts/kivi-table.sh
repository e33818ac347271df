#!/usr/bin/env bash
# The README's 4,096-token KIVI table (issue 13): one `perplexity` process per cache mode on
# the first 4,096 tokens of fixtures/heldout.txt, then `cache-table` for the bytes, then a
# markdown table with Δ against the fp32 cache of the same region (dense / sink 4 + window 252).
#
#   scripts/kivi-table.sh MODEL.gguf OUTDIR [BIN]     (BIN defaults to target/release/tinygpt-cpu)
#
# The decode-speed columns come from `TINYGPT_SMOLLM2=MODEL.gguf cargo bench --bench decode --
# decode_kivi` (one decode step with 4,096 tokens seen, 1 thread, CPU-time clock): run it
# first; without its results in target/criterion the columns print "—". TABLE_ONLY=1 skips
# the perplexity and cache-table runs and prints the table from OUTDIR's files.
#
# Each mode is a separate process, so the wall time per mode (times.txt) is its decode time
# for 4,095 teacher-forced tokens, one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:?usage: scripts/kivi-table.sh MODEL.gguf OUTDIR [BIN]}
OUT=${2:?usage: scripts/kivi-table.sh MODEL.gguf OUTDIR [BIN]}
BIN=${3:-target/release/tinygpt-cpu}
N=4096
mkdir -p "$OUT"
if [ -z "${TABLE_ONLY:-}" ]; then
: > "$OUT/times.txt"
run() { # name, flags...
    local name=$1; shift
    local s e
    s=$(date +%s.%N)
    "$BIN" perplexity "$M" --text fixtures/heldout.txt --max-tokens $N --chunk 512 --json "$@" > "$OUT/$name.json"
    e=$(date +%s.%N)
    echo "$name $(python3 -c "print(f'{$e - $s:.1f}')") $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/times.txt"
}
S="--streaming-llm-sink 4 --streaming-llm-window 252"
run dense_fp32
run dense_int8 --kv-quantize int8
run dense_int4 --kv-quantize int4
run dense_int4_pre --kv-quantize int4 --kv-key-rope pre
run dense_int4_r128 --kv-quantize int4 --kv-residual 128
run dense_int4_r128_pre --kv-quantize int4 --kv-residual 128 --kv-key-rope pre
run dense_k8v4 --kv-quantize-k int8 --kv-quantize-v int4
run dense_int2_r32 --kv-quantize int2 --kv-residual 32
run dense_int2_r128 --kv-quantize int2 --kv-residual 128
run dense_int2_r128_pre --kv-quantize int2 --kv-residual 128 --kv-key-rope pre
run dense_k4v2_r128 --kv-quantize-k int4 --kv-quantize-v int2 --kv-residual 128
run dense_int2_r128_g16 --kv-quantize int2 --kv-residual 128 --kv-group-size 16
run s_fp32 $S
run s_int8 $S --kv-quantize int8
run s_int4 $S --kv-quantize int4
run s_int2_r128 $S --kv-quantize int2 --kv-residual 128
run s_k4v2_r128 $S --kv-quantize-k int4 --kv-quantize-v int2 --kv-residual 128
run s_int4_pre $S --kv-quantize int4 --kv-key-rope pre
run s_int4_r128 $S --kv-quantize int4 --kv-residual 128
run s_int4_r128_pre $S --kv-quantize int4 --kv-residual 128 --kv-key-rope pre
run s_k8v4 $S --kv-quantize-k int8 --kv-quantize-v int4
run s_int2_r32 $S --kv-quantize int2 --kv-residual 32
run s_int2_r128_pre $S --kv-quantize int2 --kv-residual 128 --kv-key-rope pre
run s_int2_r128_g16 $S --kv-quantize int2 --kv-residual 128 --kv-group-size 16
"$BIN" cache-table "$M" --lengths $N --json \
    --modes fp32,int8,int4,int4+r128,k8v4,int2+r32,int2+r128,k4v2+r128 > "$OUT/bytes.json"
"$BIN" cache-table "$M" --lengths $N --json --kv-group-size 16 --modes int2+r128 > "$OUT/bytes_g16.json"
fi
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
by = {r["mode"]: r["bytes"] for r in json.load(open(f"{d}/bytes.json"))["rows"]}
if os.path.exists(f"{d}/bytes_g16.json"):  # K groups of 16 tokens: the "+g16" row
    for r in json.load(open(f"{d}/bytes_g16.json"))["rows"]:
        by[r["mode"].replace("int2+r128", "int2+r128+g16")] = r["bytes"]
def ppl(n):
    f = f"{d}/{n}.json"
    return json.load(open(f))["ppl"] if os.path.exists(f) else None
base = {"dense": ppl("dense_fp32"), "s": ppl("s_fp32")}
rows = ["fp32", "int8", "int4", "int4+pre", "int4+r128", "int4+r128+pre", "k8v4",
        "int2+r32", "int2+r128", "int2+r128+pre", "int2+r128+g16", "k4v2+r128"]
def step_ms(label, region):
    f = f"target/criterion/decode_kivi_smollm2/{label}-{region}/4K-cpu/new/estimates.json"
    return json.load(open(f))["mean"]["point_estimate"] / 1e6 if os.path.exists(f) else None
def speed(label, region):
    t, t0 = step_ms(label, region), step_ms("fp32", region)
    if t is None or t0 is None:
        return "—"
    return f"{1e3 / t:.1f} ({t0 / t:.2f}×)"
print("| KV mode | dense ppl | Δ vs fp32 | bytes at 4K | decode tok/s at 4K | sink 4 + window 252 ppl | Δ vs fp32 | bytes | decode tok/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for label in rows:
    key = label.replace("+", "_")
    cells = [label]
    for reg, suffix in (("dense", ""), ("s", ",sink=4,window=252")):
        p = ppl(f"{reg}_{key}")
        b = by.get(label.replace("+pre", "") + suffix)
        bs = f"{b / 2**20:.2f} MiB" if b else "—"
        if p is None:
            cells += ["—", "—", bs]
        else:
            delta = "" if label == "fp32" else f"{(p / base[reg] - 1) * 100:+.2f}%"
            cells += [f"{p:.3f}", delta, bs]
        cells.append(speed(label, "dense" if reg == "dense" else "streaming"))
    print("| " + " | ".join(cells) + " |")
PY
