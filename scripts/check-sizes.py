#!/usr/bin/env python3
"""House limits (docs/contributing.md): no source file over 1,000 lines and no function
over 150 lines, tests and generated tables aside.

    scripts/check-sizes.py            # checks src/, reference/src/, types/src/, python/src/
    scripts/check-sizes.py --list 80  # prints every function longer than 80 lines

A function's length counts from its `fn` line to its closing brace. `#[cfg(test)]` modules
(`mod tests { ... }` and `#[cfg(test)] mod name;` files) are left out, as are files under
tests/ and benches/. Exits 1 naming each file or function over its limit.
"""
import argparse
import os
import re
import sys

ROOTS = ["src", "reference/src", "types/src", "python/src"]
MAX_FILE = 1000
MAX_FN = 150
FN_RE = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?((const|async|unsafe|extern\s+\"[^\"]*\")\s+)*fn\s+(\w+)")


def strip(line, state):
    """Removes comments and string/char literal contents; `state` carries an open block
    comment or raw/plain string across lines."""
    out = []
    i = 0
    n = len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"] -= 1
            i = j + 2
            continue
        if state["str"] is not None:
            end = state["str"]
            if end == '"':
                while i < n:
                    if line[i] == "\\":
                        i += 2
                        continue
                    if line[i] == '"':
                        break
                    i += 1
                if i >= n:
                    return "".join(out)
                i += 1
                state["str"] = None
                continue
            j = line.find(end, i)
            if j < 0:
                return "".join(out)
            i = j + len(end)
            state["str"] = None
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] += 1
            i += 2
            continue
        m = re.match(r'b?r(#*)"', line[i:])
        if m and (i == 0 or not (line[i - 1].isalnum() or line[i - 1] == "_")):
            state["str"] = '"' + m.group(1)
            i += m.end()
            out.append('""')
            continue
        if c == '"':
            state["str"] = '"'
            i += 1
            out.append('""')
            continue
        if c == "'":
            m = re.match(r"'(\\.|\\u\{[0-9a-fA-F]+\}|\\x..|[^\\'])'", line[i:])
            if m:
                i += m.end()
                out.append("' '")
                continue
        out.append(c)
        i += 1
    return "".join(out)


def scan(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    state = {"block": 0, "str": None}
    code = [strip(l, state) for l in lines]
    fns = []  # (name, start, end)
    skip_until = -1
    i = 0
    pending_cfg_test = False
    while i < len(code):
        l = code[i]
        if i <= skip_until:
            i += 1
            continue
        if re.match(r"\s*#\[cfg\(test\)\]", l):
            pending_cfg_test = True
            i += 1
            continue
        if pending_cfg_test and re.match(r"\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", l):
            skip_until = block_end(code, i)
            pending_cfg_test = False
            i = skip_until + 1
            continue
        if l.strip() and not l.strip().startswith("#["):
            pending_cfg_test = False
        m = FN_RE.match(l)
        if m:
            end = block_end(code, i)
            if end is not None:
                fns.append((m.group(5), i + 1, end + 1))
        i += 1
    return len(lines), fns


def block_end(code, start):
    """Index of the line closing the first `{` at or after `start` (None for a `fn ...;`)."""
    depth = 0
    opened = False
    for j in range(start, len(code)):
        for ch in code[j]:
            if ch == "{":
                depth += 1
                opened = True
            elif ch == "}":
                depth -= 1
                if opened and depth == 0:
                    return j
            elif ch == ";" and not opened and depth == 0:
                return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", type=int, metavar="N", help="print every function longer than N lines")
    ap.add_argument("roots", nargs="*", default=ROOTS)
    args = ap.parse_args()
    bad = []
    for root in args.roots:
        if not os.path.isdir(root):
            continue
        for dirpath, _, files in os.walk(root):
            for name in sorted(files):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, name)
                if name == "tests.rs" or "/tests/" in path:
                    continue
                n, fns = scan(path)
                if n > MAX_FILE:
                    bad.append(f"{path}: {n} lines (limit {MAX_FILE})")
                for fname, a, b in fns:
                    length = b - a + 1
                    if args.list is not None and length > args.list:
                        print(f"{path}:{a}: fn {fname} {length} lines")
                    if length > MAX_FN:
                        bad.append(f"{path}:{a}: fn {fname} is {length} lines (limit {MAX_FN})")
    for b in bad:
        print(b, file=sys.stderr)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
