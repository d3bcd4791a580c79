"""Line charts drawn on the server as inline SVG: the stats page needs no JavaScript library
and no internet access, and renders the same in any browser (or in a saved page).

Django-free: numbers in, SVG markup out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = {
    "green": "#2e7d32",
    "orange": "#ef6c00",
    "red": "#c62828",
    "purple": "#6a1b9a",
    "grey": "#757575",
    "blue": "#1565c0",
    "teal": "#00838f",
    "brown": "#6d4c41",
}


@dataclass(frozen=True)
class Series:
    label: str
    color: str
    values: Sequence[float | None]  # one per time point; None: no data (a gap in the line)


@dataclass(frozen=True)
class Reference:
    """A horizontal line, such as the deadline."""

    value: float
    label: str
    color: str = PALETTE["red"]


def nice_step(span: float, ticks: int = 4) -> float:
    """A 1, 2 or 5 times a power of ten step that cuts `span` into about `ticks` parts."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power


def _format(value: float, unit: str) -> str:
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif value == int(value):
        text = f"{int(value)}"
    else:
        text = f"{value:.1f}"
    return f"{text}{unit}"


@dataclass(frozen=True)
class _Frame:
    """Where a chart's values land: the plot's box, its time span and its y scale."""

    left: int
    top: int
    plot_w: int
    plot_h: int
    start: float  # epoch seconds at the left edge
    span_s: float
    y_max: float
    step: float  # between two y ticks

    def x(self, t: float) -> float:
        return self.left + self.plot_w * (t - self.start) / self.span_s

    def y(self, v: float) -> float:
        return self.top + self.plot_h * (1 - min(v, self.y_max) / self.y_max)


def line_chart(
    *,
    title: str,
    times: Sequence[float],
    series: Sequence[Series],
    now: float,
    unit: str = "",
    y_max: float | None = None,
    reference: Reference | None = None,
    width: int = 480,
    height: int = 230,
) -> str:
    """An SVG line chart of `series` over `times` (epoch seconds), the x axis in minutes
    before `now`. The y axis starts at 0 and ends at a round number above every value, the
    reference line included, unless `y_max` fixes it."""
    frame = _frame(times, series, now, y_max, reference, width, height)
    parts = [
        *_heading(title, width, height, frame.left),
        *_y_grid(frame, unit),
        *_x_labels(frame, now, height),
        f'<line x1="{frame.left}" y1="{frame.top + frame.plot_h}" '
        f'x2="{frame.left + frame.plot_w}" y2="{frame.top + frame.plot_h}" '
        'stroke="#999" stroke-width="1"/>',
        *(_reference_line(frame, reference) if reference is not None else []),
        *(part for item in series for part in _line(frame, times, item)),
        *_legend(series, frame.left),
        "</svg>",
    ]
    return "\n".join(parts)


def _frame(
    times: Sequence[float],
    series: Sequence[Series],
    now: float,
    y_max: float | None,
    reference: Reference | None,
    width: int,
    height: int,
) -> _Frame:
    left, right, top, bottom = 56, 12, 48, 28
    start = times[0] - 10 if times else now - 3600
    values = [v for s in series for v in s.values if v is not None]
    highest = max([*values, reference.value if reference else 0.0, 0.0])
    if y_max is None:
        step = nice_step(highest * 1.1 or 1.0)
        y_max = step * max(1, math.ceil(highest * 1.1 / step))
    else:
        step = nice_step(y_max)
    plot_w, plot_h = width - left - right, height - top - bottom
    return _Frame(left, top, plot_w, plot_h, start, max(1.0, now - start), y_max, step)


def _heading(title: str, width: int, height: int, left: int) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold" fill="#333">'
        f"{escape(title)}</text>",
    ]


def _y_grid(frame: _Frame, unit: str) -> list[str]:
    """A grid line and a label at each y tick."""
    parts = []
    tick = 0.0
    while tick <= frame.y_max + 1e-9:
        ty = frame.y(tick)
        parts.append(
            f'<line x1="{frame.left}" y1="{ty:.1f}" x2="{frame.left + frame.plot_w}" '
            f'y2="{ty:.1f}" stroke="#e0e0e0" stroke-width="1"/>'
        )
        parts.append(
            f'<text x="{frame.left - 6}" y="{ty + 4:.1f}" font-size="10" fill="#666" '
            f'text-anchor="end">{escape(_format(tick, unit))}</text>'
        )
        tick += frame.step
    return parts


def _x_labels(frame: _Frame, now: float, height: int) -> list[str]:
    """Labels back from now: every 10 minutes over an hour, every minute over minutes, every
    15 seconds over the first minutes of a new service."""
    span_s = frame.span_s
    label_step_s = 600 if span_s > 20 * 60 else 60 if span_s > 3 * 60 else 15
    parts = []
    for ago in range(0, int(span_s) + 1, label_step_s):
        tx = frame.x(now - ago)
        if tx < frame.left:
            break
        label = "now" if ago == 0 else f"-{ago // 60} min" if label_step_s >= 60 else f"-{ago} s"
        parts.append(
            f'<text x="{tx:.1f}" y="{height - 8}" font-size="10" fill="#666" '
            f'text-anchor="middle">{label}</text>'
        )
    return parts


def _reference_line(frame: _Frame, reference: Reference) -> list[str]:
    ry = frame.y(reference.value)
    right = frame.left + frame.plot_w
    return [
        f'<line class="reference" x1="{frame.left}" y1="{ry:.1f}" x2="{right}" '
        f'y2="{ry:.1f}" stroke="{reference.color}" stroke-width="1.5" '
        'stroke-dasharray="6 4"/>',
        f'<text x="{right - 4}" y="{ry - 4:.1f}" font-size="10" '
        f'fill="{reference.color}" text-anchor="end">{escape(reference.label)}</text>',
    ]


def _line(frame: _Frame, times: Sequence[float], item: Series) -> list[str]:
    """One series' line, broken where a point has no data; a lone point drawn as a dot."""
    commands: list[str] = []
    dots: list[str] = []
    run: list[tuple[float, float]] = []
    for t, v in [*zip(times, item.values, strict=True), (math.nan, None)]:
        if v is not None:
            run.append((frame.x(t), frame.y(v)))
            continue
        if len(run) == 1:
            dots.append(
                f'<circle class="point" data-series="{escape(item.label)}" '
                f'cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="2.5" fill="{item.color}"/>'
            )
        elif run:
            commands.append("M" + " L".join(f"{px:.1f} {py:.1f}" for px, py in run))
        run = []
    path = (
        [
            f'<path class="series" data-series="{escape(item.label)}" '
            f'd="{" ".join(commands)}" fill="none" stroke="{item.color}" '
            'stroke-width="2" stroke-linejoin="round"/>'
        ]
        if commands
        else []
    )
    return path + dots


def _legend(series: Sequence[Series], left: int) -> list[str]:
    """The series' names, in a row under the title."""
    parts = []
    legend_x = float(left)
    for item in series:
        parts.append(
            f'<line x1="{legend_x}" y1="30" x2="{legend_x + 14}" y2="30" '
            f'stroke="{item.color}" stroke-width="3"/>'
        )
        parts.append(
            f'<text x="{legend_x + 18}" y="34" font-size="11" fill="#333">'
            f"{escape(item.label)}</text>"
        )
        legend_x += 30 + 6.5 * len(item.label)
    return parts
