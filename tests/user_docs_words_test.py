#!/usr/bin/env python3
"""README.md has the sections a new user looks for, the two commands first.
The user-facing texts speak of the product, not of how it was made: no
'session', 'issue N' or 'breaker' in README.md, python/README.md,
docs/README.md and every --help text of the CLI, and no requirement id
(F20, X3, ...) in them, python/README.md and docs/errors.md unless the
glossary (docs/design.md) is linked on the same line.

    user_docs_words_test.py SOURCE_DIR CCALLOC_BIN
"""
import re
import subprocess
import sys

HISTORY = re.compile(r"session|issue [0-9]|breaker", re.I)
SPEC_ID = re.compile(r"\b(SPEC\b|[BCEFPRSX][0-9]{1,2}\b)")


def main():
    root, cli = sys.argv[1:3]
    texts = {}
    for name in ["README.md", "python/README.md", "docs/README.md", "docs/errors.md"]:
        with open(f"{root}/{name}", encoding="utf-8") as f:
            texts[name] = f.read()
    for sub in ["", "replay", "report", "compare", "config-keys"]:
        args = [cli] + ([sub] if sub else []) + ["--help"]
        texts[" ".join(["ccalloc", sub, "--help"])] = subprocess.run(args, capture_output=True, text=True,
                                                                       timeout=60).stdout
    bad = []
    # README's sections a new user looks for.
    for heading in ["## Why", "## Install", "## Quick start: PyTorch", "## Quick start: C++", "## Quick start: C",
                    "## Quick start: replay a trace", "## Configuration", "## Compared with PyTorch's allocator",
                    "## Known limitations", "## Documentation"]:
        if heading + "\n" not in texts["README.md"]:
            bad.append(f"README.md: no heading '{heading}'")
    if not texts["README.md"].startswith("# ccalloc\n\n<!-- commands -->\n```sh\nscripts/main.sh"):
        bad.append("README.md: the two commands are not at the top")
    for name, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                bad.append(f"{name}:{n}: history word: {line.strip()}")
            if "--help" not in name and SPEC_ID.search(line) and "design.md" not in line:
                bad.append(f"{name}:{n}: requirement id without the glossary link: {line.strip()}")
    for b in bad:
        print("FAIL:", b)
    if not bad:
        print(f"ok  : {len(texts)} texts without history words or bare requirement ids")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
