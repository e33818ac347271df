#!/usr/bin/env bash
# Soak test: generate TOKENS tokens (default 1,000,000) from the bundled model with a
# bounded int4 cache (sink 4 + window 252) and check that resident memory stays flat.
#
#   scripts/soak.sh [TOKENS] [CSV]
#
# Samples VmRSS from /proc/PID/status every second into CSV (default soak_rss.csv:
# seconds,vmrss_kib). After a warm-up (the first WARMUP seconds, default 20), the largest
# VmRSS may exceed the VmRSS at the end of the warm-up by at most 1%; otherwise the script
# fails. Linux only (/proc). Not part of CI: it runs for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS="${1:-1000000}"
CSV="${2:-soak_rss.csv}"
WARMUP="${WARMUP:-20}"
BIN="${BIN:-target/release/tinygpt-cpu}"
[ -x "$BIN" ] || cargo build --release
"$BIN" sample --prompt "Once upon a time" --tokens "$TOKENS" --ignore-eos --seed 1 \
    --streaming-llm-sink 4 --streaming-llm-window 252 --kv-quantize int4 \
    > /dev/null 2> "$CSV.report" &
PID=$!
START=$(date +%s)
echo "seconds,vmrss_kib" > "$CSV"
while kill -0 "$PID" 2> /dev/null; do
    RSS=$(awk '/^VmRSS:/ {print $2}' "/proc/$PID/status" 2> /dev/null || true)
    [ -n "$RSS" ] && echo "$(( $(date +%s) - START )),$RSS" >> "$CSV"
    sleep 1
done
wait "$PID"
ELAPSED=$(( $(date +%s) - START ))
cat "$CSV.report"
awk -F, -v warm="$WARMUP" -v secs="$ELAPSED" -v tokens="$TOKENS" '
    NR == 1 { next }
    $1 <= warm { base = $2; first = (first == "" ? $2 : first); next }
    { n++; if ($2 > max) max = $2; last = $2 }
    END {
        if (n == 0 || base == "") { print "soak: run too short for the warm-up (" secs " s)"; exit 1 }
        growth = (max - base) / base * 100
        printf "soak: %d tokens in %d s; VmRSS first %d KiB, after %d s warm-up %d KiB, max after %d KiB, last %d KiB (%+.2f%%)\n", tokens, secs, first, warm, base, max, last, growth
        if (growth > 1.0) { print "soak: FAIL: RSS grew by more than 1% after the warm-up"; exit 1 }
        print "soak: OK"
    }' "$CSV"
