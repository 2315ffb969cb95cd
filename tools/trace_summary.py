"""Summarize a taskrt trace: the old entry point, now a thin alias of `python -m tools.trace summary`.

    python -m tools.trace_summary traces/demo.trace.jsonl

`summarize(events)` and `format_summary(summary)` keep their shape (per processor or copy channel:
count, busy microseconds, bytes, utilization; the span) for callers such as apps/demo.py.
"""
from __future__ import annotations

import sys

from tools import exit_with, trace


def summarize(events: list[dict]) -> dict:
    """Per processor (or copy channel): count, busy microseconds, bytes, utilization; and the run's span."""
    if not events:
        return {"span_us": 0.0, "by_proc": {}}
    # the old callers' events may carry only proc, start, end, bytes and kind
    full = sorted(({"rank": 0, "name": "", "op": "", "kind": "task", "bytes": 0, **e} for e in events),
                  key=lambda e: e["start"])
    s = trace.summary(trace.Trace(full))
    by_proc: dict[str, dict] = {}
    for r in s["rows"]:
        row = by_proc.setdefault(r["proc"], {"count": 0, "busy_us": 0.0, "bytes": 0, "utilization": 0.0})
        row["count"] += r["count"]
        row["busy_us"] += r["busy_us"] + r["copy_us"]
        row["bytes"] += r["bytes"]
    for row in by_proc.values():
        row["utilization"] = row["busy_us"] / s["span_us"] if s["span_us"] > 0 else 0.0
    return {"span_us": s["span_us"], "by_proc": by_proc}


def format_summary(summary: dict) -> str:
    lines = [f"span {summary['span_us'] / 1e3:.2f} ms",
             f"{'processor / channel':<28}{'events':>8}{'busy ms':>10}{'util':>7}{'MB':>9}"]
    for proc, row in sorted(summary["by_proc"].items()):
        lines.append(f"{proc:<28}{row['count']:>8}{row['busy_us'] / 1e3:>10.2f}{row['utilization']:>7.0%}"
                     f"{row['bytes'] / 1e6:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """`python -m tools.trace summary ARGS`."""
    return trace.main(["summary", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_with(main)
