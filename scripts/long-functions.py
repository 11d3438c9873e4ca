#!/usr/bin/env python3
"""Lists the functions of the C++ sources under src/ longer than a limit.

    scripts/long-functions.py [--max-lines 80] [ROOT]

A function's length is its lines from the first line of its signature to
its closing brace, both included. The scan matches braces (comments, string
and character literals skipped; raw strings are not understood): a brace
that opens at namespace or class level after a header with a '(' (and no
'=' just before it) starts a function; everything up to its matching brace
is the function, lambdas and nested blocks included. Good enough to find
long functions, not a C++ parser.

EXCEPTIONS lists the functions that may stay long, each with why. Prints
one line per function over the limit ("LINES path:line name", longest
first) and exits 1 if any is not an exception.
"""
import argparse
import os
import re
import sys

# (file, function name) -> why it may be long.
EXCEPTIONS = {
    ("src/core/config.cpp", "key_table"): "a data table: one entry per configuration key, no logic",
}

CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b|\bextern\s*\"C\"")
CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|try)\b")


def blank_comments_and_literals(text):
    """`text` with comments and the insides of literals replaced by spaces
    (newlines kept, so line numbers stay)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                out[i] = " "
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for j in range(i, end):
                if text[j] != "\n":
                    out[j] = " "
            i = end
        elif c in "\"'":
            # A digit separator (1'000) is no character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                if text[j] == "\\":
                    out[j] = " "
                    j += 1
                out[j] = " "
                j += 1
            i = j + 1
        else:
            i += 1
    return "".join(out)


def function_name(header):
    """The name before the parameter list of a function header."""
    m = re.search(r"([~\w:]+(?:operator\s*\S+?)?)\s*\(", header)
    return m.group(1).split("::")[-1] if m else "?"


def long_functions(path, rel, max_lines):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = blank_comments_and_literals(f.read())
    found = []
    stack = []  # one entry per open brace: "container", "function" or "block"
    header_start = 0  # offset where the current header began
    function_open = None  # (start line, name) of the function being read
    for i, c in enumerate(text):
        if c in ";":
            if "function" not in stack:
                header_start = i + 1
        elif c == "{":
            header = text[header_start:i]
            if "function" in stack:
                stack.append("block")
            elif "(" in header and not header.rstrip().endswith("=") and not CONTROL.match(header):
                stack.append("function")
                first = header_start + (len(header) - len(header.lstrip()))
                function_open = (text.count("\n", 0, first) + 1, function_name(header))
            elif CONTAINER.search(header):
                stack.append("container")
            else:
                stack.append("block")
            header_start = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "block"
            if kind == "function" and function_open:
                start, name = function_open
                lines = text.count("\n", 0, i) + 1 - start + 1
                if lines > max_lines:
                    found.append((lines, rel, start, name))
                function_open = None
            rest = text[i + 1:i + 80].lstrip()
            # A brace initializer of a constructor's member list (a_{x}, b_{y} {)
            # continues the header.
            if "function" not in stack and not (rest.startswith(",") or rest.startswith("{")):
                header_start = i + 1
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-lines", type=int, default=80)
    parser.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    found = []
    for directory, _, files in os.walk(os.path.join(root, "src")):
        for name in sorted(files):
            if name.endswith((".cpp", ".hpp", ".h", ".cu")):
                path = os.path.join(directory, name)
                found += long_functions(path, os.path.relpath(path, root), args.max_lines)
    failed = False
    for lines, rel, line, name in sorted(found, reverse=True):
        why = EXCEPTIONS.get((rel, name))
        failed = failed or why is None
        print(f"{lines:5d} {rel}:{line} {name}" + (f"  (exception: {why})" if why else ""))
    if not found:
        print(f"no function in src/ is longer than {args.max_lines} lines")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
