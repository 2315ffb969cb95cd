"""Summarize a taskrt trace file: time per processor, busy fraction, copies and bytes moved.

    python -m tools.trace_summary traces/demo.trace.jsonl
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from taskrt.tracing import read_trace


def summarize(events: list[dict]) -> dict:
    """Per processor (or copy channel): count, busy microseconds, bytes; and the run's span."""
    if not events:
        return {"span_us": 0.0, "by_proc": {}}
    start = min(e["start"] for e in events)
    end = max(e["end"] for e in events)
    by_proc: dict[str, dict] = defaultdict(lambda: {"count": 0, "busy_us": 0.0, "bytes": 0})
    for e in events:
        row = by_proc[e["proc"]]
        row["count"] += 1
        row["busy_us"] += e["end"] - e["start"]
        row["bytes"] += e["bytes"]
    span = end - start
    for row in by_proc.values():
        row["utilization"] = row["busy_us"] / span if span > 0 else 0.0
    return {"span_us": span, "by_proc": dict(by_proc)}


def format_summary(summary: dict) -> str:
    lines = [f"span {summary['span_us'] / 1e3:.2f} ms",
             f"{'processor / channel':<28}{'events':>8}{'busy ms':>10}{'util':>7}{'MB':>9}"]
    for proc, row in sorted(summary["by_proc"].items()):
        lines.append(f"{proc:<28}{row['count']:>8}{row['busy_us'] / 1e3:>10.2f}{row['utilization']:>7.0%}"
                     f"{row['bytes'] / 1e6:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    args = parser.parse_args(argv)
    _, events = read_trace(args.trace)
    print(format_summary(summarize(events)))


if __name__ == "__main__":
    main()
