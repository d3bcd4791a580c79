"""Server-side SVG charts."""

from __future__ import annotations

import re

from operations.charts import Reference, Series, line_chart, nice_step


def test_nice_steps() -> None:
    assert [nice_step(s) for s in (4, 9, 130, 0.7)] == [1, 5, 50, 0.2]


def test_lines_break_at_gaps_and_lone_points_are_dots() -> None:
    times = [1000.0 + 10 * i for i in range(8)]
    values = [1.0, 2.0, None, 4.0, None, 3.0, 5.0, 6.0]
    svg = line_chart(
        title="t <&>", times=times, now=1080, series=[Series("a", "#123456", values)],
        reference=Reference(10, "deadline 10"),
    )  # fmt: skip
    found = re.search(r'data-series="a" d="([^"]+)"', svg)
    assert found
    path = found.group(1)
    assert path.count("M") == 2  # [1, 2] and [3, 5, 6]; the lone 4 is a dot
    assert path.count("L") == 1 + 2
    assert svg.count("<circle") == 1
    assert 'class="reference"' in svg
    assert "deadline 10" in svg
    assert "t &lt;&amp;&gt;" in svg  # the title is escaped
    # the y axis covers the reference line: its top label is at least 10
    labels = [float(v) for v in re.findall(r'text-anchor="end">([\d.]+)<', svg)]
    assert max(labels) >= 10


def test_an_empty_chart_still_draws_axes() -> None:
    svg = line_chart(
        title="none", times=[1.0, 2.0], now=3, series=[Series("a", "#000", [None, None])]
    )
    assert "<path" not in svg
    assert "<svg" in svg
    assert "now" in svg
