"""The HTML report and the conversation timeline, checked in real headless Chromium.

Each file must load with no console output or errors, hold the expected number of marks in the
rendered DOM, need no network, and give a screenshot that is not blank. Negative controls prove
the checks can fail. Chromium is Debian's package (``make test`` installs it).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from kvdiag.diagnostics.advise import advise
from kvdiag.diagnostics.html_report import write_html_report
from kvdiag.diagnostics.html_timeline import render_conversation_html, render_conversations_html
from kvdiag.diagnostics.records import Evidence
from kvdiag.diagnostics.report import build_report, build_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations
from kvdiag.schema.verdicts import Verdict

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--mute-audio", "--hide-scrollbars")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    assert CHROMIUM is not None, "chromium is not installed: run `make sysdeps` (apt-get install chromium)"
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          timeout=90, check=False)


def load_page(tmp_path: Path, page: Path) -> tuple[str, list[str]]:
    """The DOM after scripts ran, and every console message or uncaught error the page produced."""
    res = _chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2000", "--dump-dom",
                    page.resolve().as_uri())
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    console = [ln for ln in res.stderr.decode(errors="replace").splitlines() if ":CONSOLE" in ln]
    return res.stdout.decode(), console


def decode_png(data: bytes) -> np.ndarray:
    """RGB(A) pixels of an 8-bit, non-interlaced PNG (what Chromium writes), all five filter types."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    width = height = channels = 0
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + size]
        pos += 12 + size
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0, (depth, interlace)
            channels = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
        elif kind == b"IDAT":
            idat.append(body)
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, 1 + width * channels)
    out = np.zeros((height, width * channels), dtype=np.int32)
    prev = np.zeros(width * channels, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 1:
            cur = np.cumsum(line.reshape(width, channels), axis=0).reshape(-1) & 255
        elif kind == 2:
            cur = (line + prev) & 255
        else:
            c, p, row = [0] * len(line), prev.tolist(), line.tolist()
            for i, v in enumerate(row):
                a = c[i - channels] if i >= channels else 0
                b = p[i]
                d = p[i - channels] if i >= channels else 0
                if kind == 3:
                    c[i] = (v + ((a + b) >> 1)) & 255
                else:
                    pa, pb, pc = abs(b - d), abs(a - d), abs(a + b - 2 * d)
                    c[i] = (v + (a if pa <= pb and pa <= pc else b if pb <= pc else d)) & 255
            cur = np.array(c, dtype=np.int32)
        out[y], prev = cur, cur
    return out.reshape(height, width, channels)


def screenshot_spread(tmp_path: Path, page: Path, size: str = "1000,700") -> float:
    """Standard deviation of the screenshot's RGB pixels (0 for a blank page)."""
    shot = tmp_path / f"{page.stem}.png"
    res = _chromium(tmp_path, f"--screenshot={shot}", f"--window-size={size}", page.resolve().as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr.decode(errors="replace")[-2000:]
    pixels = decode_png(shot.read_bytes())
    return float(pixels[..., :3].std())


def _count(dom: str, pattern: str) -> int:
    return len(re.findall(pattern, dom))


def _no_network(html: str) -> None:
    # Self-contained: the only URL is the SVG namespace (an identifier, never fetched).
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", html)) - {"http://www.w3.org/2000/svg"}
    assert not urls, urls
    assert "<link" not in html and " src=" not in html


def test_report_html_renders_every_mark(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=80, missing_metadata_share=0.05, seed=2))
    adv = advise(convs, 480.0, router_ttl=450.0)
    page = write_html_report(convs, tmp_path / "report.html", advice=adv)
    html = page.read_text()
    _no_network(html)
    dom, console = load_page(tmp_path, page)
    assert console == []
    rep = build_report(build_turn_table(convs), 480.0)
    nonzero = int((rep.by_turn.drop(columns=["turns", "reused_share"]) > 0).to_numpy().sum())
    mix_turn = dom.split('id="mix-turn-chart"')[1].split("</svg>")[0]
    assert _count(mix_turn, r'class="seg"') == nonzero
    assert f'data-turns="{len(rep.table)}"' in dom
    ttft = dom.split('id="ttft-chart"')[1].split("</svg>")[0]
    filled = int((rep.ttft[["reused_n", "recomputed_n"]] > 0).to_numpy().sum())
    assert _count(ttft, r'class="bar"') == filled
    gaps = dom.split('id="gap-chart"')[1].split("</svg>")[0]
    assert _count(gaps, r'class="hist-bar"') == len(rep.gaps.histogram_counts)
    assert 'data-line="decode TTL"' in gaps and 'data-line="TTL for p95"' in gaps
    assert _count(dom, r'<li class="sev-') == len(adv.checks)
    assert screenshot_spread(tmp_path, page) > 10.0


def test_timeline_html_draws_each_turn_and_transfer(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=30, seed=4))
    conv = max(convs, key=lambda c: (len({t.verdict for t in c.turns}), len(c.turns)))
    conv.turns[-1].verdict = Verdict.TRANSFER_FAILED
    conv.turns[-1].status = "error"
    conv.turns[1].evidence.append(Evidence("decode.log:7", 'Releasing expired KV blocks for request <x> & "y"'))
    page = render_conversation_html(conv, tmp_path / "conv.html", decoder_ttl=480.0)
    html = page.read_text()
    _no_network(html)
    assert "&lt;x&gt; &amp; &quot;y&quot;" in html  # evidence text is escaped, never markup
    dom, console = load_page(tmp_path, page)
    assert console == []
    assert _count(dom, r'<g class="turn"') == len(conv.turns)
    reads = sum(1 for t in conv.turns if t.verdict in (Verdict.REMOTE_HIT, Verdict.EXPIRED_REMOTE_READ,
                                                       Verdict.TRANSFER_FAILED))
    assert _count(dom, r'class="xfer d2p') == reads
    assert _count(dom, r'class="xfer d2p failed"') == 1 + sum(
        1 for t in conv.turns if t.verdict is Verdict.EXPIRED_REMOTE_READ)
    assert _count(dom, r'class="xfer p2d"') == len(conv.turns) - 1  # the failed turn never reached D
    assert _count(dom, r'<g class="gap"') == len(conv.turns) - 1
    assert _count(dom, r'<tr class="turn-row"') == len(conv.turns)
    for t in conv.turns:
        assert f'data-turn="{t.turn}" data-verdict="{t.verdict.value}"' in dom
    assert screenshot_spread(tmp_path, page, "1400,600") > 10.0


def test_many_conversations_in_one_file(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=3, seed=9))
    dom, console = load_page(tmp_path, render_conversations_html(convs, tmp_path / "all.html"))
    assert console == []
    assert _count(dom, r'<svg class="timeline"') == 3
    assert _count(dom, r'<g class="turn"') == sum(len(c.turns) for c in convs)


def test_checks_can_fail(tmp_path: Path) -> None:
    # Negative controls: a page that logs and throws is caught; a blank page is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>x</p><script>console.error('boom'); nope();</script></body></html>")
    _, console = load_page(tmp_path, bad)
    assert any("boom" in ln for ln in console) and any("nope is not defined" in ln for ln in console)
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    assert screenshot_spread(tmp_path, blank, "300,200") < 1.0


@pytest.mark.parametrize("kind", [0, 1, 2, 3, 4])
def test_png_decoder_handles_every_filter(kind: int) -> None:
    rng = np.random.default_rng(kind)
    img = rng.integers(0, 256, size=(5, 7, 3), dtype=np.int32)
    flat = img.reshape(5, -1)
    rows, prev = [], np.zeros(21, dtype=np.int32)
    for cur in flat:
        left = np.concatenate([np.zeros(3, dtype=np.int32), cur[:-3]])
        upleft = np.concatenate([np.zeros(3, dtype=np.int32), prev[:-3]])
        if kind == 3:
            pred = (left + prev) >> 1
        elif kind == 4:
            pa, pb, pc = np.abs(prev - upleft), np.abs(left - upleft), np.abs(left + prev - 2 * upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        else:
            pred = [np.zeros_like(cur), left, prev][kind]
        rows.append(bytes([kind]) + ((cur - pred) & 255).astype(np.uint8).tobytes())
        prev = cur

    def chunk(kind_: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind_ + body + struct.pack(">I", zlib.crc32(kind_ + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 7, 5, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))
    assert (decode_png(png) == img).all()
