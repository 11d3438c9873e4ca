#!/usr/bin/env python3
"""Fails when a file of a layer includes a header of a layer above it
(src/README.md, "Layers": each layer includes only itself and the layers
below). Every target shares include/, so the compiler would not notice.

usage: layers_check.py SOURCE_DIR   prints each wrong-direction include; exit 1 if any
"""
import pathlib
import re
import sys

# Rank of each layer; a file may include headers of its own rank or lower.
RANK = {"base": 0, "backend": 1, "core": 2, "frontend": 3, "capi": 4, "replay": 5}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]ccalloc/(?:([a-z_]+)/|(ccalloc\.h))', re.M)


def layer_of(path: pathlib.Path, root: pathlib.Path):
    rel = path.relative_to(root).parts
    if rel[0] == "src" and rel[1] in RANK:
        return rel[1]
    if rel[:2] == ("include", "ccalloc"):
        return "capi" if rel[2] == "ccalloc.h" else rel[2] if rel[2] in RANK else None
    return None


def main() -> int:
    root = pathlib.Path(sys.argv[1]).resolve()
    bad = []
    for path in sorted([*root.glob("src/**/*"), *root.glob("include/ccalloc/**/*")]):
        if path.suffix not in (".hpp", ".cpp", ".h") or not path.is_file():
            continue
        layer = layer_of(path, root)
        if layer is None:
            continue
        for m in INCLUDE.finditer(path.read_text(encoding="utf-8")):
            target = "capi" if m.group(2) else m.group(1)
            if target in RANK and RANK[target] > RANK[layer]:
                line = path.read_text(encoding="utf-8")[: m.start()].count("\n") + 1
                bad.append(f"{path.relative_to(root)}:{line}: layer {layer} includes {target} (a layer above it)")
    for b in bad:
        print(b)
    print(f"layers_check: {len(bad)} wrong-direction include(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
