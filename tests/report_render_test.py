#!/usr/bin/env python3
"""Renders `ccalloc report` of the bundled gpt2_train trace in headless
Chromium and checks that the plots are drawn (SPEC X8, issue 5).

    python3 tests/report_render_test.py CCALLOC_BIN OUT_DIR

Writes OUT_DIR/report.html and OUT_DIR/report.png (1120 x 2600 pixels), then
counts the screenshot's pixels of each plot colour (the report's palette):
the reserved and allocated curves, the recording allocator's dashed curve,
the requested area, and the blocks of the segment map must each cover a
plausible area, and the hover script must have run without error (the DOM
Chromium dumps after it ran still has the chart and no error text). Exit
status 0 pass, 1 fail, 77 skip (no chromium).
"""

import os
import shutil
import struct
import subprocess
import sys
import zlib

# The report's colours (src/replay/report.cpp) and the fewest pixels each
# must cover in the screenshot.
EXPECTED = {
    "ccalloc reserved curve": ((0x2f, 0x6d, 0xb5), 800),
    "ccalloc allocated curve": ((0x59, 0xa1, 0x4f), 600),
    "recording allocator curve": ((0xe8, 0x77, 0x2e), 400),
    "requested area": ((0xca, 0xd5, 0xe0), 20000),  # #bac8d6 at 75% over the plot background #fbfcfd
    "segment map blocks": ((0x4e, 0x79, 0xa7), 15000),
}


def read_png(path):
    """(width, height, rows of RGB tuples) of an 8-bit RGB or RGBA PNG."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            if depth != 8 or color not in (2, 6):
                raise ValueError(f"{path}: unsupported PNG (depth {depth}, colour type {color})")
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if filt == 1:
                line[i] = (line[i] + a) & 255
            elif filt == 2:
                line[i] = (line[i] + b) & 255
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows, channels


def count_colors(rows, channels, targets, tolerance=10):
    counts = {name: 0 for name in targets}
    wanted = {name: rgb for name, (rgb, _) in targets.items()}
    for line in rows:
        for x in range(0, len(line), channels):
            r, g, b = line[x], line[x + 1], line[x + 2]
            if r > 235 and g > 235 and b > 235:
                continue  # background: most pixels
            for name, (tr, tg, tb) in wanted.items():
                if abs(r - tr) <= tolerance and abs(g - tg) <= tolerance and abs(b - tb) <= tolerance:
                    counts[name] += 1
                    break
    return counts


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    binary, out_dir = sys.argv[1], sys.argv[2]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        print("SKIP: no chromium (scripts/deps.sh installs the Debian package)")
        return 77
    os.makedirs(out_dir, exist_ok=True)
    html = os.path.join(out_dir, "report.html")
    png = os.path.join(out_dir, "report.png")
    subprocess.run([binary, "report", "-o", html], check=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--user-data-dir=" + os.path.join(out_dir, "chromium-profile")]
    subprocess.run([chromium, *flags, f"--screenshot={png}", "--window-size=1120,2600", "file://" + html],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    dom = subprocess.run([chromium, *flags, "--dump-dom", "file://" + html], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    failures = []
    if dom.count('<polyline class="curve"') != 3 or 'id="segmap"' not in dom or 'id="readout"' not in dom:
        failures.append("the rendered DOM lacks the curves, the segment map or the readout")
    width, height, rows, channels = read_png(png)
    if (width, height) != (1120, 2600):
        failures.append(f"screenshot is {width}x{height}, expected 1120x2600")
    counts = count_colors(rows, channels, EXPECTED)
    for name, (rgb, least) in EXPECTED.items():
        status = "ok" if counts[name] >= least else "TOO FEW"
        print(f"{name:28s} {counts[name]:8d} pixels (at least {least}) {status}")
        if counts[name] < least:
            failures.append(f"{name}: {counts[name]} pixels of #{bytes(rgb).hex()}, expected at least {least}")
    print(f"screenshot: {png}")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(EXPECTED) + 1 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
