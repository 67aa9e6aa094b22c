"""A line chart as PNG bytes, from the standard library alone (the control plane has no matplotlib).

    .venv/bin/python -c "from tasks.curve_png import line_chart_png; open('/tmp/c.png', 'wb').write(line_chart_png([(1, 2.0), (2, 1.0)]))"

No text: the summary beside the chart gives the numbers. The chart is drawn on a pixel grid: a light
frame, a faint gridline at each quarter of the value range, and the curve through the points in order.
"""

from __future__ import annotations

import struct
import zlib

BACKGROUND = (255, 255, 255)
FRAME = (200, 200, 200)
GRID = (238, 238, 238)
LINE = (31, 119, 180)
MARGIN = 8  # pixels between the image's edge and the plot area


def line_chart_png(points: list[tuple[float, float]], *, width: int = 480, height: int = 200,
                   color: tuple[int, int, int] = LINE) -> bytes:
    """An RGB PNG of `points` ((x, y) pairs, drawn in order), scaled to fill the plot area: the lowest y
    at the bottom, the highest at the top. ValueError when there is nothing to draw."""
    if not points:
        raise ValueError("line_chart_png: no points to draw")
    if width < 4 * MARGIN or height < 4 * MARGIN:
        raise ValueError(f"line_chart_png: {width}x{height} is too small (at least {4 * MARGIN} px a side)")
    pixels = [bytearray(bytes(BACKGROUND) * width) for _ in range(height)]
    left, top, right, bottom = MARGIN, MARGIN, width - 1 - MARGIN, height - 1 - MARGIN
    for quarter in (1, 2, 3):
        _line(pixels, left, top + (bottom - top) * quarter // 4, right, top + (bottom - top) * quarter // 4, GRID)
    for x0, y0, x1, y1 in ((left, top, right, top), (right, top, right, bottom), (right, bottom, left, bottom),
                           (left, bottom, left, top)):
        _line(pixels, x0, y0, x1, y1, FRAME)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_span, y_span = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0

    def to_pixel(x: float, y: float) -> tuple[int, int]:
        # A single point, or a flat curve, sits in the middle rather than on the frame.
        px = left + (right - left) * ((x - min(xs)) / x_span if max(xs) > min(xs) else 0.5)
        py = bottom - (bottom - top) * ((y - min(ys)) / y_span if max(ys) > min(ys) else 0.5)
        return round(px), round(py)

    scaled = [to_pixel(x, y) for x, y in points]
    for (x0, y0), (x1, y1) in zip(scaled, scaled[1:] or scaled):
        for dy in (0, 1):  # two pixels thick: one-pixel lines vanish when the UI scales the image down
            _line(pixels, x0, y0 + dy, x1, y1 + dy, color)
    return _encode_png(width, height, pixels)


def _line(pixels: list[bytearray], x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
    """Bresenham's line, clipped to the image."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    error = dx + dy
    while True:
        if 0 <= y0 < len(pixels) and 0 <= x0 < len(pixels[0]) // 3:
            pixels[y0][3 * x0:3 * x0 + 3] = bytes(color)
        if x0 == x1 and y0 == y1:
            return
        doubled = 2 * error
        if doubled >= dy:
            error, x0 = error + dy, x0 + sx
        if doubled <= dx:
            error, y0 = error + dx, y0 + sy


def _encode_png(width: int, height: int, rows: list[bytearray]) -> bytes:
    # Each scanline starts with its filter type; 0 (none) is enough for a chart that is mostly background.
    raw = b"".join(b"\x00" + bytes(row) for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
