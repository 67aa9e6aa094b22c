"""Headless Chromium for the UI tests: open a page of the local stack's Prefect UI, keep its screenshot and
read what it rendered (text, images, links, table rows) from the DOM after its scripts ran.

Prefect's UI is a single-page app: the HTML the server sends is an empty shell, so only a browser that runs
its scripts shows what a user sees. Chromium is Debian's (`make test` installs it); `LORAFLOW_CHROMIUM`
points at another binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = Path(os.environ.get("LORAFLOW_CHROMIUM", "/usr/bin/chromium"))
# The flags that work on these machines (no GPU, no sandbox as root, no network but the stack's).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Virtual time runs only while nothing is loading: the UI's API calls finish before the budget ends, and a
# page is dumped once its timers (polling every few seconds) have had 30 s of virtual time to render it.
VIRTUAL_TIME_BUDGET_MS = 30_000
WINDOW = (1400, 2000)
CALL_TIMEOUT_S = 120  # ~10 s a page on an idle machine; several times that on a loaded 2-core one


class BrowserError(AssertionError):
    """Chromium is missing, failed, or ran past its time; the message says what to do."""


def require_chromium(binary: Path = CHROMIUM) -> Path:
    """`binary`, once it is known to be an executable; else a BrowserError naming the fix."""
    if not os.access(binary, os.X_OK):
        raise BrowserError(f"no Chromium at {binary}: the UI tests open the Prefect UI in headless Chromium. Run "
                           "`make test`, which installs it, or `sudo apt-get install chromium` (or point "
                           "LORAFLOW_CHROMIUM at a Chromium binary)")
    return binary


@dataclass
class Page:
    url: str
    dom: str
    screenshot: Path
    text: str = ""
    images: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    """(href, text) of every `<a>`."""
    rows: list[list[str]] = field(default_factory=list)
    """The cells' text of every table row, header rows included."""


def open_page(url: str, screenshot: Path, *, until: str | None = None, tries: int = 3,
              binary: Path = CHROMIUM, timeout_s: float = CALL_TIMEOUT_S) -> Page:
    """Load `url`, save its screenshot to `screenshot` and return what it rendered. When `until` is given, load
    again (up to `tries` times) until the page's text contains it: a loaded machine can leave the app still
    fetching when the virtual time runs out. The last page is returned either way; the caller asserts."""
    for attempt in range(1, tries + 1):
        page = _load(url, screenshot, binary, timeout_s)
        if until is None or until in page.text:
            return page
        time.sleep(2 * attempt)
    return page


def run_chromium(args: list[str], *, binary: Path = CHROMIUM, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """Run Chromium with FLAGS, a fresh profile and `args`; its stdout. Chromium starts a tree of processes
    (zygote, GPU, renderers): it runs in its own process group, and on timeout the whole group is killed by
    its id, so no renderer outlives the call."""
    require_chromium(binary)
    profile = tempfile.mkdtemp(prefix="loraflow-chromium-")
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([str(binary), *FLAGS, f"--user-data-dir={profile}", *args], stdout=out,
                                    stderr=err, start_new_session=True)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise BrowserError(f"Chromium ran past {timeout_s:.0f} s on {args[-1]} and was killed "
                                   f"(process group {proc.pid})") from None
            finally:
                _reap_group(proc.pid)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if proc.returncode != 0:
            raise BrowserError(f"Chromium exited with code {proc.returncode} on {args[-1]}:\n{stderr[-3000:]}")
        return stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def process_group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: a killed helper whose parent is
    gone waits for PID 1 to reap it, which a container's PID 1 may never do."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name, in parentheses, may hold spaces: state and group come after it.
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows (3 bytes a pixel) of an 8-bit, non-interlaced RGB or RGBA PNG, as Chromium
    writes its screenshots (every scanline filter undone)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    offset, header, idat = 8, b"", b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        header, idat = (body, idat) if kind == b"IHDR" else (header, idat + body if kind == b"IDAT" else idat)
        offset += 12 + length
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or interlace or color_type not in (2, 6):
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {color_type}, interlace {interlace}")
    channels = 3 if color_type == 2 else 4
    stride, raw = channels * width, zlib.decompress(idat)
    previous, rows = bytearray(stride), []
    for y in range(height):
        start = y * (stride + 1)
        line = _unfilter(raw[start], bytearray(raw[start + 1:start + 1 + stride]), previous, channels)
        rows.append(bytes(line) if channels == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
        previous = line
    return width, height, rows


def count_pixels(png: Path, colors: list[tuple[int, int, int]], tolerance: int = 0) -> list[int]:
    """For each of `colors`, the pixels of the PNG at `png` within `tolerance` (per channel) of it."""
    _, _, rows = decode_png(png.read_bytes())
    counts = [0] * len(colors)
    for row in rows:
        for i in range(0, len(row), 3):
            r, g, b = row[i], row[i + 1], row[i + 2]
            for k, (r0, g0, b0) in enumerate(colors):
                if abs(r - r0) <= tolerance and abs(g - g0) <= tolerance and abs(b - b0) <= tolerance:
                    counts[k] += 1
    return counts


def _load(url: str, screenshot: Path, binary: Path, timeout_s: float) -> Page:
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    dom = run_chromium([f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                        f"--screenshot={screenshot}", "--dump-dom", url], binary=binary, timeout_s=timeout_s)
    reader = _DomReader()
    reader.feed(dom)
    return Page(url, dom, screenshot, " ".join("".join(reader.text).split()), reader.images, reader.links, reader.rows)


def _reap_group(pgid: int, wait_s: float = 10) -> None:
    """Chromium's helpers leave a moment after the browser; kill the ones that linger."""
    deadline = time.monotonic() + wait_s
    while process_group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def _unfilter(kind: int, line: bytearray, previous: bytearray, bpp: int) -> bytearray:
    # Pure Python (the control plane has no numpy or Pillow): the common filters get the cheap paths.
    if kind == 0:
        return line
    if kind == 2:
        return bytearray((a + b) & 0xFF for a, b in zip(line, previous))
    n = len(line)
    if kind == 1:
        for i in range(bpp, n):
            line[i] = (line[i] + line[i - bpp]) & 0xFF
    elif kind == 3:
        for i in range(n):
            line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + previous[i]) // 2) & 0xFF
    elif kind == 4:
        for i in range(n):
            if i < bpp:
                line[i] = (line[i] + previous[i]) & 0xFF  # Paeth with no left neighbour picks `up`
                continue
            a, b, c = line[i - bpp], previous[i], previous[i - bpp]
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return line


class _DomReader(HTMLParser):
    """Text, images, links and table rows of a dumped DOM (scripts and styles left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.images: list[str] = []
        self.links: list[tuple[str, str]] = []
        self.rows: list[list[str]] = []
        self._skip = 0
        self._href: str | None = None
        self._link_text: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "img":
            self.images.append(values.get("src") or "")
        elif tag == "a":
            self._href, self._link_text = values.get("href") or "", []
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag == "a" and self._href is not None:
            self.links.append((self._href, " ".join("".join(self._link_text).split())))
            self._href = None
        elif tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        self.text.append(data)
        if self._href is not None:
            self._link_text.append(data)
        if self._cell is not None:
            self._cell.append(data)
