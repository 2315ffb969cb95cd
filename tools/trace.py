"""Trace tools: merge, export, draw, summarize, find the critical path, measure messages and
waits, and compare traces.

    python -m tools.trace merge run.rank0.jsonl run.rank1.jsonl -o run.jsonl
    python -m tools.trace chrome run.jsonl -o run.chrome.json [--flows ID]
    python -m tools.trace timeline run.jsonl -o run.png
    python -m tools.trace summary run.jsonl [--json]
    python -m tools.trace critical-path sim.jsonl [--json]
    python -m tools.trace messages run.jsonl [--json]
    python -m tools.trace waits run.jsonl [--json] [--top N] [--skip N]
    python -m tools.trace compare sim.jsonl run.jsonl -o compare.png [--json] [--skip N]

A path that does not exist but whose rank files do (run.jsonl -> run.rank0.jsonl, ...) stands
for all of them; where it exists too, it is read only as their merge written after them. Every
command reads its traces with `load`, which checks them: a truncated, empty or foreign file, or
ranks of two runs (each rank's meta names its run), raises `TraceError` naming the file and the
line (the CLI prints that one line and exits with status 2).

Dependences: runtime and simulator traces carry each event's `preds` (the task graph's edges,
node ids; on many ranks they may name another rank's nodes, which a merged trace holds). For a
trace without them they are inferred from timing: an event waits on the event before it on its
processor or link and on the latest event anywhere that ended before it started.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from taskrt.outputs import output_problem
from taskrt.tracing import rank_trace_path
from tools import LineParser, exit_with, png_problem

REQUIRED = ("id", "name", "kind", "rank", "proc", "start", "end", "bytes")
PHASE_SUFFIXES = ((".fwd", "forward"), (".bwd", "backward"), (".update", "update"), (".infer", "inference"))
#: timeline geometry in pixels: fixed width, a fixed margin plus a fixed height per row
DPI, WIDTH_PX, MARGIN_PX, ROW_PX = 100, 1400, 160, 18
#: the tracks an image draws at most, the busiest (a simulation on 1,024 devices has 20,000-110,000)
MOST_ROWS = 200
#: how far (us) an event may start before the end of the one it waits on (rounding of the times)
EPS_US = 0.01


class TraceError(ValueError):
    """A trace file that cannot be read as a taskrt trace: the message names the file and line."""


@dataclass
class Trace:
    """Events of one or more ranks on one clock, sorted by start; `meta` holds the ranks, the
    source files, whether simulated, and each file's own meta line (`per_file`)."""

    events: list[dict]
    meta: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Trace({len(self.events)} events, ranks {self.ranks}, {self.span_us / 1e3:.3f} ms)"

    @property
    def ranks(self) -> list[int]:
        return sorted({e["rank"] for e in self.events})

    @property
    def where(self) -> str:
        """The files it was read from, as an error names them ("trace" for one made in memory)."""
        return ", ".join(self.meta.get("sources", [])) or "trace"

    @property
    def simulated(self) -> bool:
        return bool(self.meta.get("simulated"))

    @property
    def start_us(self) -> float:
        """The first event's start; 0 in a simulation, whose iteration starts there (its first
        events start after their launch)."""
        if self.simulated:
            return 0.0
        return min((e["start"] for e in self.events), default=0.0)

    @property
    def end_us(self) -> float:
        return max((e["end"] for e in self.events), default=0.0)

    @property
    def span_us(self) -> float:
        return self.end_us - self.start_us

    def rows(self) -> list[tuple[int, str]]:
        """(rank, processor or link) of every track: by rank, processors before links, in index order."""
        return sorted({(e["rank"], e["proc"]) for e in self.events}, key=_row_key)


def _row_key(row: tuple[int, str]):
    rank, proc = row
    natural = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", proc)]
    return rank, "->" in proc, natural


def row_label(row: tuple[int, str]) -> str:
    """A track's name: the processor, or a link with the rank it was seen from when that is not obvious."""
    rank, proc = row
    return proc if proc.startswith(f"r{rank}.") else f"{proc} @r{rank}"


def phase(event: dict) -> str:
    """forward, backward, update, inference or fill for tasks by name; copy or reduce for the rest."""
    kind, name = event["kind"], event["name"]
    if kind != "task":
        return "reduce" if kind == "reduce" else "copy"
    if name.startswith("fill:"):
        return "fill"
    name = re.sub(r"\[\d+\]$", "", name)  # one launch per position along an ordered dim: "lstm.bwd[3]"
    for suffix, ph in PHASE_SUFFIXES:
        if name.endswith(suffix):
            return ph
    return name.split(":")[0] if ":" in name else "task"


def operator(event: dict) -> str:
    """The model operator of an event, else its name's stem ('stencil_ab', 'attach')."""
    return event.get("op") or event["name"].split(":")[0]


def is_task(event: dict) -> bool:
    return event["kind"] == "task"


# ---- reading ---------------------------------------------------------------------------------
def _read_file(path: str) -> tuple[dict, list[dict]]:
    """(meta, events) of one file, checked line by line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a taskrt trace: byte {e.start} is not UTF-8 text") from None
    lines = text.split("\n")
    if not text.strip():
        raise TraceError(f"{path}:1: empty file, not a taskrt trace")
    meta, events = None, []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            last = lineno == len(lines) or not any(x.strip() for x in lines[lineno:])
            what = ("truncated" if last and not text.endswith("\n") else
                    "not JSON on one line (a trace has a JSON object a line)")
            raise TraceError(f"{path}:{lineno}: {what}: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise TraceError(f"{path}:{lineno}: not a taskrt trace: JSON nested too deeply") from None
        if meta is None:
            if not isinstance(rec, dict) or rec.get("kind") != "meta":
                raise TraceError(f"{path}:{lineno}: not a taskrt trace: the first line is not a meta line "
                                 f"(kind 'meta'), it is {line[:60]!r}")
            meta = rec
            if "rank" in meta and not (_is_int(meta["rank"]) and meta["rank"] >= 0):
                raise TraceError(f"{path}:{lineno}: bad meta 'rank': {meta['rank']!r} (it must be an integer >= 0)")
            if "ranks" in meta and not (isinstance(meta["ranks"], list) and all(_is_int(r) and r >= 0
                                                                             for r in meta["ranks"])):
                raise TraceError(f"{path}:{lineno}: bad meta 'ranks': {meta['ranks']!r} (it must be a list of "
                                 f"integers >= 0)")
            if "run" in meta and not (isinstance(meta["run"], (int, float)) and not isinstance(meta["run"], bool)
                                      and math.isfinite(meta["run"])):
                raise TraceError(f"{path}:{lineno}: bad meta 'run': {meta['run']!r} (it must be a number: when the "
                                 f"run's rank 0 began, in seconds)")
            continue
        events.append(_check_event(rec, path, lineno))
    if not events:
        raise TraceError(f"{path}:{len(lines)}: no events after the meta line")
    want = meta.get("events")
    if isinstance(want, int) and want != len(events):
        raise TraceError(f"{path}:{len(lines)}: truncated: the meta line says {want} events, the file has "
                         f"{len(events)}")
    return meta, events


def _check_event(rec, path: str, lineno: int) -> dict:
    if not isinstance(rec, dict):
        raise TraceError(f"{path}:{lineno}: an event must be an object, not {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise TraceError(f"{path}:{lineno}: not a taskrt event: it lacks {missing}")
    start, end = rec["start"], rec["end"]
    if not all(_is_number(t) and math.isfinite(t) for t in (start, end)) or end < start:
        raise TraceError(f"{path}:{lineno}: bad times: start {start!r}, end {end!r} (microseconds, end >= start)")
    for key, ok, want in _FIELDS:
        if key in rec and not ok(rec[key]):
            raise TraceError(f"{path}:{lineno}: bad {key!r}: {rec[key]!r} (it must be {want})")
    return rec


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: what an event is: a task, a copy or a fold inside a rank, or a rank's half of a copy between ranks
EVENT_KINDS = ("task", "copy", "reduce", "send", "recv")
#: the kinds of a message's two ends, on a link between ranks
MESSAGE_KINDS = ("send", "recv")

#: (field, check, what it must be) of an event's fields other than its times
_FIELDS = (
    ("id", _is_int, "an integer"),
    ("name", lambda x: isinstance(x, str) and x != "", "a non-empty string"),
    ("kind", lambda x: x in EVENT_KINDS, ", ".join(EVENT_KINDS)),
    ("rank", lambda x: _is_int(x) and x >= 0, "a rank, an integer >= 0"),
    ("proc", lambda x: isinstance(x, str) and x != "", "a non-empty string: a processor, or source->destination"),
    ("bytes", lambda x: x is None or (_is_int(x) and x >= 0), "an integer >= 0 or null"),
    ("op", lambda x: x is None or isinstance(x, str), "a string or null"),
    ("preds", lambda x: isinstance(x, list) and all(map(_is_int, x)), "a list of event ids"),
    ("point", lambda x: x is None or (isinstance(x, list) and all(map(_is_int, x))), "a list of integers or null"),
)


def _expand(paths) -> list[str]:
    """Paths as given, a run's base path standing for its rank files."""
    out = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        p = str(p)
        ranks = _rank_files(p)
        if ranks and os.path.exists(p) and not _merged_from(p, ranks):
            raise TraceError(f"{p}: both it and rank files {', '.join(ranks)} exist, and it is not their merge (one "
                             f"is left from another run): name the files to read")
        out.extend([p] if os.path.exists(p) else ranks or [p])
    if not out:
        raise TraceError("no trace files given")
    return out


def _rank_files(path: str) -> list[str]:
    """The rank files that `path` stands for (rank 0, 1, ... while they exist)."""
    out = []
    while os.path.exists(rank_trace_path(path, len(out))):
        out.append(rank_trace_path(path, len(out)))
    return out


def _merged_from(path: str, ranks: list[str]) -> bool:
    """Whether the file `path` is `merge`'s of the files `ranks`: of the same run, written after them."""
    meta, first = _first_meta(path), _first_meta(ranks[0])
    sources = meta.get("sources")
    if not isinstance(sources, list) or sorted(map(os.path.basename, map(str, sources))) != \
            sorted(map(os.path.basename, ranks)):
        return False
    if meta.get("run") != first.get("run"):   # (a merge of another run's files of the same names)
        return False
    return all(os.path.getmtime(r) <= os.path.getmtime(path) for r in ranks)


def _first_meta(path: str) -> dict:
    """A trace file's first line as a dict, or {} where it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.loads(f.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def load(paths) -> Trace:
    """One trace from one or more files (a run's ranks), checked and merged on one clock.

    Each rank's runtime already adds its clock offset against rank 0 (the meta's
    `clock_offset_us`), so the times of all ranks count from rank 0's origin; merging keeps
    them and sorts the events by start. Two files of one rank, or a simulated file with a
    measured one, are an error."""
    files = _expand(paths)
    events, per_file, seen = [], {}, {}
    simulated = set()
    runs = {}   # the run a file's meta names (rank 0's start, mpi_clock) -> the first file naming it
    for path in files:
        meta, evs = _read_file(path)
        ranks = meta.get("ranks") or sorted({e["rank"] for e in evs})
        for r in ranks:
            if r in seen:
                raise TraceError(f"{path}:1: rank {r} is also in {seen[r]}")
            seen[r] = path
        if "run" in meta:
            runs.setdefault(meta["run"], path)
            if len(runs) > 1:
                first, other = runs.items()
                raise TraceError(f"{path}:1: of another run than {first[1]} (their runs began "
                                 f"{abs(other[0] - first[0]):.3f} s apart): give the rank files of one run")
        simulated.add(bool(meta.get("simulated")))
        if len(simulated) > 1:
            raise TraceError(f"{path}:1: cannot merge a simulated trace with a measured one")
        per_file[path] = meta
        events.extend(evs)
    events.sort(key=lambda e: (e["start"], e["end"], e["rank"]))
    meta = {"kind": "meta", "ranks": sorted(seen), "sources": files, "unit": "us", "simulated": simulated.pop(),
            "per_file": per_file, **({"run": next(iter(runs))} if runs else {})}
    return Trace(events, meta)


def write_merged(trace: Trace, path: str) -> str:
    """The merged trace as one file in the same format (meta: ranks, sources)."""
    meta = {k: v for k, v in trace.meta.items() if k != "per_file"}
    meta.update(events=len(trace.events), rank=trace.ranks[0] if trace.ranks else 0)
    iteration = [m["iteration_us"] for m in trace.meta.get("per_file", {}).values() if "iteration_us" in m]
    if iteration:
        meta["iteration_us"] = max(iteration)
    with open(path, "w") as f:
        f.write(json.dumps(meta) + "\n")
        for e in trace.events:
            f.write(json.dumps(e) + "\n")
    return path


# ---- dependences and the critical path ---------------------------------------------------------
def dependences(trace: Trace) -> list[list[int]]:
    """For each event (by index), the indices of the events it waited on: its `preds` where the
    trace has them, else inferred from timing; the previous event on its track (not on a link,
    whose messages are in flight side by side); and a receipt's send (the same id)."""
    events = trace.events
    by_row: dict[tuple, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if e["kind"] not in MESSAGE_KINDS:
            by_row[(e["rank"], e["proc"])].append(i)
    deps: list[list[int]] = [[] for _ in events]
    for idx in by_row.values():
        for a, b in zip(idx, idx[1:]):
            if events[a]["end"] <= events[b]["start"] + EPS_US:
                deps[b].append(a)
    if any("preds" in e for e in events):
        by_id: dict = defaultdict(list)
        for i, e in enumerate(events):
            by_id[e["id"]].append(i)
        for i, e in enumerate(events):
            deps[i].extend(j for p in e.get("preds", ()) for j in by_id.get(p, ()) if j != i)
            if e["kind"] == "recv":
                deps[i].extend(j for j in by_id.get(e["id"], ()) if events[j]["kind"] == "send")
    else:   # the latest event to end by this one's start, and before it in (end, start, index) order:
        # two events of no length at one time would each have waited on the other
        def key(i):
            return events[i]["end"], events[i]["start"], i
        order = sorted(range(len(events)), key=key)
        ends = [events[i]["end"] for i in order]
        for i, e in enumerate(events):
            k = bisect.bisect_right(ends, e["start"] + EPS_US)
            while k > 0 and key(order[k - 1]) >= key(i):
                k -= 1
            if k > 0:
                deps[i].append(order[k - 1])
    return deps


def critical_path(trace: Trace) -> list[dict]:
    """The chain that ends last, walked back through each event's latest-ending dependence: in
    order, each with its duration, the wait before it and its share of the trace's span."""
    events, deps = trace.events, dependences(trace)
    if not events:
        return []
    span = trace.span_us or 1.0
    i = max(range(len(events)), key=lambda k: events[k]["end"])
    chain, seen = [i], {i}
    while True:
        e = events[i]
        # a receipt is posted early and waits inside its event: what it waited on ends before its end
        by = e["end"] if e["kind"] == "recv" else e["start"]
        ready = [j for j in deps[i] if events[j]["end"] <= by + EPS_US and j not in seen]
        if not ready:   # (an event met before: a loop of events within EPS_US of each other)
            break
        i = max(ready, key=lambda j: events[j]["end"])
        chain.append(i)
        seen.add(i)
    chain.reverse()
    out, prev_end = [], trace.start_us
    for i in chain:
        e = events[i]
        dur = e["end"] - max(e["start"], prev_end)   # (a receipt's own part: from its send's end)
        out.append({"id": e["id"], "name": e["name"], "kind": e["kind"], "op": operator(e), "phase": phase(e),
                    "rank": e["rank"], "proc": e["proc"], "start_us": e["start"], "end_us": e["end"],
                    "duration_us": round(dur, 3), "wait_us": round(max(0.0, e["start"] - prev_end), 3),
                    "share": dur / span})
        prev_end = e["end"]
    return out


def format_critical_path(path: list[dict], span_us: float) -> str:
    busy = sum(p["duration_us"] for p in path)
    lines = [f"critical path: {len(path)} events, {busy / 1e3:.3f} ms busy of {span_us / 1e3:.3f} ms "
             f"({busy / span_us if span_us else 0:.0%}), the rest waiting",
             f"{'start ms':>10}{'ms':>9}{'wait ms':>9}{'share':>7}  {'where':<22}event"]
    t0 = path[0]["start_us"] - path[0]["wait_us"] if path else 0.0
    for p in path:
        lines.append(f"{(p['start_us'] - t0) / 1e3:>10.3f}{p['duration_us'] / 1e3:>9.3f}{p['wait_us'] / 1e3:>9.3f}"
                     f"{p['share']:>7.1%}  {p['proc']:<22}{p['name']} ({p['phase']})")
    return "\n".join(lines)


# ---- summary -----------------------------------------------------------------------------------
def _union_us(spans: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def summary(trace: Trace, top: int = 10) -> dict:
    """Per track: events, task (busy) and copy microseconds, idle time and utilization over the
    trace's span; the `top` operators by task time; totals per rank and per phase."""
    span = trace.span_us
    spans: dict[tuple, list] = defaultdict(list)
    rows: dict[tuple, dict] = {}
    for e in trace.events:
        key = (e["rank"], e["proc"])
        row = rows.setdefault(key, {"rank": e["rank"], "proc": e["proc"], "link": "->" in e["proc"], "count": 0,
                                    "busy_us": 0.0, "copy_us": 0.0, "bytes": 0})
        row["count"] += 1
        row["busy_us" if is_task(e) else "copy_us"] += e["end"] - e["start"]
        row["bytes"] += e["bytes"] or 0
        spans[key].append((e["start"], e["end"]))
    for key, row in rows.items():
        used = _union_us(spans[key])
        row["idle_us"] = max(0.0, span - used)
        row["utilization"] = used / span if span > 0 else 0.0
    ops: dict[str, dict] = {}
    phases: dict[str, float] = defaultdict(float)
    task_total = 0.0
    for e in trace.events:
        if not is_task(e):
            continue
        dur = e["end"] - e["start"]
        o = ops.setdefault(operator(e), {"op": operator(e), "count": 0, "time_us": 0.0, "phases": defaultdict(float)})
        o["count"] += 1
        o["time_us"] += dur
        o["phases"][phase(e)] += dur
        phases[phase(e)] += dur
        task_total += dur
    ranked = sorted(ops.values(), key=lambda o: -o["time_us"])
    for o in ranked:
        o["share"] = o["time_us"] / task_total if task_total else 0.0
        o["phases"] = dict(o["phases"])
    ranks: dict[str, dict] = {}
    for row in rows.values():
        r = ranks.setdefault(str(row["rank"]), {"tracks": 0, "events": 0, "busy_us": 0.0, "copy_us": 0.0, "bytes": 0})
        r["tracks"] += 1
        r["events"] += row["count"]
        r["busy_us"] += row["busy_us"]
        r["copy_us"] += row["copy_us"]
        r["bytes"] += row["bytes"]
    return {"span_us": span, "simulated": trace.simulated, "events": len(trace.events),
            "rows": [rows[k] for k in sorted(rows, key=_row_key)], "operators": ranked[:top],
            "phases": dict(phases), "ranks": ranks}


def format_summary(s: dict) -> str:
    """The summary as terminal tables: tracks, operators, ranks."""
    lines = [f"span {s['span_us'] / 1e3:.3f} ms, {s['events']} events{' (simulated)' if s['simulated'] else ''}",
             f"{'processor / link':<30}{'events':>7}{'busy ms':>10}{'copy ms':>10}{'idle ms':>10}{'util':>6}"
             f"{'MB':>9}"]
    for r in s["rows"]:
        lines.append(f"{row_label((r['rank'], r['proc'])):<30}{r['count']:>7}{r['busy_us'] / 1e3:>10.3f}"
                     f"{r['copy_us'] / 1e3:>10.3f}{r['idle_us'] / 1e3:>10.3f}{r['utilization']:>6.0%}"
                     f"{r['bytes'] / 1e6:>9.2f}")
    lines.append("(busy and copy ms add up each event's time, overlapping ones each in full: a link "
                 "carries copies side by side; idle and util are of the time any event ran)")
    lines += ["", f"{'operator':<30}{'tasks':>7}{'ms':>10}{'share':>7}  phases (ms)"]
    for o in s["operators"]:
        ph = ", ".join(f"{k} {v / 1e3:.3f}" for k, v in sorted(o["phases"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{o['op']:<30}{o['count']:>7}{o['time_us'] / 1e3:>10.3f}{o['share']:>7.1%}  {ph}")
    lines += ["", f"{'rank':<6}{'tracks':>7}{'events':>8}{'busy ms':>10}{'copy ms':>10}{'MB':>9}"]
    for rank, r in sorted(s["ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{rank:<6}{r['tracks']:>7}{r['events']:>8}{r['busy_us'] / 1e3:>10.3f}{r['copy_us'] / 1e3:>10.3f}"
                     f"{r['bytes'] / 1e6:>9.2f}")
    return "\n".join(lines)


# ---- messages between ranks ------------------------------------------------------------------------
def _quantiles(values: list[float]) -> dict:
    """10th percentile, median, 90th percentile (the nearest ranks) and mean of `values` (some)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[round(q * (len(ordered) - 1))]
    return {"p10": at(0.1), "median": statistics.median(ordered), "p90": at(0.9), "mean": statistics.fmean(ordered)}


def messages(trace: Trace) -> dict:
    """Each message between ranks in flight: from its send's post (the send event's start) to its
    receipt's completion (the recv event's end), on the merged clock. The k-th send of a name on
    a link pairs with the k-th receipt of that name there (MPI keeps one sender's messages of a
    tag in order). What the simulator's `message_delay` stands for, less the wire's time
    (docs/accuracy.md, session 36). Quantiles in us, in all and per link, by the message's size
    (`by_size`, _by_size) and by how long the receiving rank had been quiet (`by_quiet`, _by_quiet)."""
    where = trace.where
    sends, receipts = defaultdict(list), defaultdict(list)
    for e in trace.events:   # (sorted by start)
        if e["kind"] in MESSAGE_KINDS:
            (sends if e["kind"] == "send" else receipts)[(e["proc"], e["name"])].append(e)
    if not sends or not receipts:
        raise TraceError(f"{where}: no messages between ranks (no "
                         f"{'send' if not sends else 'recv'} events: a trace of one rank needs its other ranks' "
                         f"files, and a simulated trace has copies, not messages)")
    flights, per_link, unpaired, sizes, pairs = [], defaultdict(list), 0, [], []
    for key in sends.keys() | receipts.keys():
        s, r = sends.get(key, []), receipts.get(key, [])
        unpaired += abs(len(s) - len(r))
        for send, receipt in zip(s, r):
            flight = receipt["end"] - send["start"]
            flights.append(flight)
            per_link[key[0]].append(flight)
            sizes.append(send["bytes"] or 0)
            pairs.append((send, receipt))
    if not flights:
        raise TraceError(f"{where}: no send pairs with a receipt of "
                         f"its name on its link (a rank's file holds its own side of each message: give every "
                         f"rank's file)")
    return {"messages": len(flights), "unpaired": unpaired, "median_bytes": statistics.median(sizes),
            "flight_us": _quantiles(flights), "links": {link: {"messages": len(f), "flight_us": _quantiles(f)}
                                                         for link, f in sorted(per_link.items())},
            "by_size": _by_size(pairs), "by_quiet": _by_quiet(pairs, receipts)}


#: the bounds (bytes) of _by_size's classes of a message's size, and their labels
SIZE_BOUNDS = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
SIZE_LABELS = ("0-4 KiB", "4-64 KiB", "64 KiB-1 MiB", "1-16 MiB", "16 MiB+")


def _by_size(pairs: list[tuple[dict, dict]]) -> dict:
    """Flights by the message's bytes (SIZE_LABELS): whether the wire sets a message's time, which
    grows with its bytes, or its handling and waits, which do not (alexnet's data parallelism on a
    2-core VM: messages of 64 KiB-1 MiB between its two ranks flew no longer than those under
    4 KiB, docs/accuracy.md, session 49). Each: {messages, flight_us}."""
    classes = defaultdict(list)
    for send, receipt in pairs:
        classes[SIZE_LABELS[bisect.bisect_right(SIZE_BOUNDS, send["bytes"] or 0)]].append(receipt["end"] - send["start"])
    return _flights_by_class(classes, SIZE_LABELS)


#: the bounds (us) of _by_quiet's classes of a receiving rank's quiet time
QUIET_BOUNDS_US = (100, 300, 700, 1500, 3000)


def _by_quiet(pairs: list[tuple[dict, dict]], receipts: dict) -> dict:
    """Flights by how long the receiving rank had been quiet when the message was sent: from the
    end of its last receipt before the send's post to that post. A rank's MPI progress thread
    naps while nothing ends, each nap twice the last up to MAX_NAP_S (taskrt/mpi_progress.py),
    so a message to a rank quiet for long waits longer for it to look. Classes '0-100', ...,
    '3000+' us, 'first' (no receipt before it), and 'posted after' (the receive was posted
    after the send: the receiver was not waiting). Each: {messages, flight_us}."""
    ends = defaultdict(list)
    for events in receipts.values():
        for e in events:
            ends[e["rank"]].append(e["end"])
    for v in ends.values():
        v.sort()
    labels = [f"{lo}-{hi}" for lo, hi in zip((0,) + QUIET_BOUNDS_US, QUIET_BOUNDS_US)] + [f"{QUIET_BOUNDS_US[-1]}+"]
    classes = defaultdict(list)
    for send, receipt in pairs:
        flight = receipt["end"] - send["start"]
        if receipt["start"] > send["start"]:
            classes["posted after"].append(flight)
            continue
        before = ends[receipt["rank"]]
        i = bisect.bisect_left(before, send["start"])
        if i == 0:
            classes["first"].append(flight)
        else:
            classes[labels[bisect.bisect_right(QUIET_BOUNDS_US, send["start"] - before[i - 1])]].append(flight)
    return _flights_by_class(classes, labels + ["first", "posted after"])


def _flights_by_class(classes: dict, labels) -> dict:
    """{label: {messages, flight_us}} of the classes (label -> flights) that have any, in `labels`' order."""
    return {label: {"messages": len(classes[label]), "flight_us": _quantiles(classes[label])}
            for label in labels if classes[label]}


def _quantile_rows(rows) -> list[str]:
    """Table lines of _quantiles, one a (label, count, quantiles) row: label, count, p10, median,
    p90, mean."""
    return [f"{label:<24}{n:>9}{q['p10']:>10.1f}{q['median']:>10.1f}{q['p90']:>10.1f}{q['mean']:>10.1f}"
            for label, n, q in rows]


def _quantile_header(label: str, count: str) -> str:
    return f"{label:<24}{count:>9}{'p10':>10}{'median':>10}{'p90':>10}{'mean':>10}"


def format_messages(m: dict) -> str:
    """messages() as a table: flight quantiles in all, per link, by size and by the receiver's quiet time."""
    return "\n".join(
        [f"{m['messages']} messages between ranks (median {_human_bytes(m['median_bytes'])}), "
         f"{m['unpaired']} unpaired; in flight from the send's post to the receipt's completion, us:",
         _quantile_header("link", "messages")]
        + _quantile_rows([("all", m["messages"], m["flight_us"])]
                         + [(link, v["messages"], v["flight_us"]) for link, v in m["links"].items()])
        + ["by the message's size, us:"]
        + _quantile_rows((label, v["messages"], v["flight_us"]) for label, v in m["by_size"].items())
        + ["by the receiving rank's quiet time, from its last receipt's end to the send's post, us:"]
        + _quantile_rows((f"quiet {label}" if label[0].isdigit() else label, v["messages"], v["flight_us"])
                         for label, v in m["by_quiet"].items()))


# ---- a task's wait for its processor -------------------------------------------------------------
def waits(trace: Trace, top: int = 10, skip: int = 0) -> dict:
    """How long tasks waited to start once they could, on a processor with nothing else to run:
    from the end of a task's last pred on its rank to its start, for the tasks whose processor
    had ended its previous task by then (a task queued behind another is left out: that wait
    is the other's time). In a run this is the runtime's hand-off: a worker woken and given the
    GIL, which the rank's other threads (the main thread issuing a later step, the progress
    thread, the copy workers) may hold (docs/accuracy.md). In a simulation it is the task's
    `launch` (the model's launch overhead, which the simulator puts before the task's event),
    longer where the processor handled a message meanwhile (the parts of a copy between ranks
    that the simulator charges beside its tasks). Preds the
    trace does not hold on the task's rank (a fence, a remote node's stand-in, another rank's
    half of a copy) are left out, so a wait may include waiting for them. Each task's first
    `skip` runs (by name, rank and point) are left out too: a run's first iteration waits for
    its kernels' compiles. Quantiles in us in all and per processor, and the `top` longest."""
    where = trace.where
    if not any("preds" in e for e in trace.events):
        raise TraceError(f"{where}: no event names its preds, so when a task could start is unknown "
                         f"(traces written by taskrt and by the simulator have them)")
    ends: dict = {}   # (rank, node id) -> the latest end of its events there
    for e in trace.events:
        key = (e["rank"], e["id"])
        ends[key] = max(ends.get(key, e["end"]), e["end"])
    rows: list[dict] = []
    last_end: dict = {}   # processor -> the end of its latest task so far (events sorted by start)
    runs: dict = defaultdict(int)   # (rank, name, point) -> its runs so far
    tasks = 0
    for e in trace.events:
        if not is_task(e):
            continue
        tasks += 1
        track = (e["rank"], e["proc"])
        before = last_end.get(track, -math.inf)
        last_end[track] = max(before, e["end"])
        run = (e["rank"], e["name"], tuple(e.get("point") or ()))
        runs[run] += 1
        if runs[run] <= skip:
            continue
        ready = max((ends[(e["rank"], p)] for p in e.get("preds", ()) if (e["rank"], p) in ends), default=None)
        if ready is not None and ready >= before:
            rows.append({"name": e["name"], "rank": e["rank"], "proc": e["proc"], "start_us": e["start"],
                         "wait_us": e["start"] - ready})
    if not rows:
        raise TraceError(f"{where}: no task started on an idle processor after a pred in the trace "
                         f"({tasks} tasks, each one's first {skip} runs left out)")
    per_proc = defaultdict(list)
    for r in rows:
        per_proc[row_label((r["rank"], r["proc"]))].append(r["wait_us"])
    return {"tasks": tasks, "counted": len(rows), "wait_us": _quantiles([r["wait_us"] for r in rows]),
            "processors": {proc: {"tasks": len(w), "wait_us": _quantiles(w)} for proc, w in sorted(per_proc.items())},
            "longest": sorted(rows, key=lambda r: -r["wait_us"])[:top]}


def format_waits(w: dict) -> str:
    """waits() as a table: quantiles in all and per processor, then the longest waits."""
    return "\n".join(
        [f"{w['counted']} of {w['tasks']} tasks started on an idle processor after their last pred; "
         f"from that pred's end to the task's start, us:", _quantile_header("processor", "tasks")]
        + _quantile_rows([("all", w["counted"], w["wait_us"])]
                         + [(proc, v["tasks"], v["wait_us"]) for proc, v in w["processors"].items()])
        + ["the longest:"]
        + [f"{r['wait_us']:>10.1f} us  {r['name']} on {row_label((r['rank'], r['proc']))} at "
           f"{r['start_us'] / 1e3:.3f} ms" for r in w["longest"]])


# ---- Chrome trace export -------------------------------------------------------------------------
def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def chrome_label(event: dict) -> str:
    """'conv1 forward' for a task of an operator, the name for other tasks, 'copy:x 4.0 KiB' for copies."""
    if is_task(event):
        ph = phase(event)
        return f"{operator(event)} {ph}" if event.get("op") else event["name"]
    return f"{event['name']} {_human_bytes(event['bytes'] or 0)}"


def chrome_events(trace: Trace, flows_for=None) -> list[dict]:
    """Chrome Trace Event records: a process per rank, a thread (track) per processor and link, a
    complete ('X') event per task and copy, one named 'launch' before each simulated node with a
    launch (the model's hand-off, on the node's track), and flow arrows in and out of the nodes
    `flows_for`."""
    rows = trace.rows()
    tid = {row: i + 1 for i, row in enumerate(rows)}
    out = []
    for rank in trace.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for row in rows:
        out.append({"ph": "M", "name": "thread_name", "pid": row[0], "tid": tid[row], "args": {"name": row_label(row)}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": row[0], "tid": tid[row],
                    "args": {"sort_index": tid[row]}})
    for e in trace.events:
        args = {"id": e["id"], "name": e["name"], "op": e.get("op") or "", "bytes": e["bytes"]}
        if e.get("point") is not None:
            args["point"] = e["point"]
        track = tid[(e["rank"], e["proc"])]
        out.append({"ph": "X", "name": chrome_label(e), "cat": phase(e), "pid": e["rank"], "tid": track,
                    "ts": e["start"], "dur": round(e["end"] - e["start"], 3), "args": args})
        if e.get("launch"):
            out.append({"ph": "X", "name": "launch", "cat": "launch", "pid": e["rank"], "tid": track,
                        "ts": round(e["start"] - e["launch"], 3), "dur": e["launch"], "args": {"of": e["id"]}})
    if flows_for is not None:
        out.extend(_flows(trace, tid, flows_for))
    return out


def _flows(trace: Trace, tid: dict, flows_for) -> list[dict]:
    wanted = {flows_for} if isinstance(flows_for, (int, str)) else set(flows_for)
    events, deps = trace.events, dependences(trace)
    chosen = [i for i, e in enumerate(events) if e["id"] in wanted]
    if not chosen:
        raise TraceError(f"{trace.meta.get('sources', ['trace'])[0]}: no event with id {sorted(wanted)} for flows")
    succ = defaultdict(list)
    for i, ds in enumerate(deps):
        for j in ds:
            succ[j].append(i)
    pairs = {(j, i) for i in chosen for j in deps[i]} | {(i, k) for i in chosen for k in succ[i]}
    out = []
    for n, (a, b) in enumerate(sorted(pairs), 1):
        src, dst = events[a], events[b]
        common = {"name": "dependence", "cat": "dependence", "id": n}
        out.append({"ph": "s", "pid": src["rank"], "tid": tid[(src["rank"], src["proc"])], "ts": src["start"],
                    **common})
        out.append({"ph": "f", "bp": "e", "pid": dst["rank"], "tid": tid[(dst["rank"], dst["proc"])],
                    "ts": dst["start"], **common})
    return out


def write_chrome(trace: Trace, path: str, flows_for=None) -> str:
    """A JSON file that Perfetto and chrome://tracing open (times in microseconds)."""
    doc = {"traceEvents": chrome_events(trace, flows_for), "displayTimeUnit": "ms",
           "otherData": {"ranks": trace.ranks, "simulated": trace.simulated,
                         "sources": trace.meta.get("sources", [])}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


# ---- images --------------------------------------------------------------------------------------
def figure_height_px(rows: int) -> int:
    return MARGIN_PX + ROW_PX * max(rows, 1)


def _colors(traces: list[Trace], most: int = 20) -> dict[str, object]:
    """A colour for each of the `most` operators with the most task time; 'other' and 'copy' grey."""
    import matplotlib

    time_of: dict[str, float] = defaultdict(float)
    for t in traces:
        for e in t.events:
            if is_task(e):
                time_of[operator(e)] += e["end"] - e["start"]
    cmap = matplotlib.colormaps["tab20"]
    ranked = sorted(time_of, key=lambda o: -time_of[o])[:most]
    colors = {o: cmap(i % 20) for i, o in enumerate(ranked)}
    colors["other"], colors["copy"] = (0.6, 0.6, 0.6, 1.0), (0.2, 0.2, 0.2, 1.0)
    colors["launch"] = (0.85, 0.85, 0.85, 1.0)   # a simulation's hand-off before a task or fold
    return colors


def _draw(ax, trace: Trace, colors: dict, xmax_ms: float, title: str | None, t0: float) -> None:
    """The trace's tracks on `ax`, time in ms from `t0` (us; the whole trace's first start where
    only its busiest tracks are drawn)."""
    rows = trace.rows()
    y = {row: i for i, row in enumerate(rows)}
    bars: dict[tuple, list] = defaultdict(list)
    for e in trace.events:
        key = "copy" if not is_task(e) else (operator(e) if operator(e) in colors else "other")
        bars[(y[(e["rank"], e["proc"])], key)].append(((e["start"] - t0) / 1e3, max((e["end"] - e["start"]) / 1e3,
                                                                                    xmax_ms * 1e-4)))
        if e.get("launch"):
            bars[(y[(e["rank"], e["proc"])], "launch")].append(((e["start"] - e["launch"] - t0) / 1e3,
                                                                e["launch"] / 1e3))
    for (row, key), spans in bars.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colors[key], linewidth=0)
    ax.set_yticks(range(len(rows)), [row_label(r) for r in rows], fontsize=7 if len(rows) > 24 else 9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, xmax_ms or 1.0)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)


def _legend(fig, colors: dict, used: set) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in colors.items() if k in used]
    fig.legend(handles=handles, loc="upper right", fontsize=8, frameon=False, bbox_to_anchor=(0.995, 0.98))


def _used_keys(traces: list[Trace], colors: dict) -> set:
    used = {("copy" if not is_task(e) else (operator(e) if operator(e) in colors else "other"))
            for t in traces for e in t.events}
    if any(e.get("launch") for t in traces for e in t.events):
        used.add("launch")
    return used


def write_timeline(trace: Trace, path: str, title: str | None = None) -> str:
    """A PNG of WIDTH_PX by figure_height_px(tracks) pixels: a row per processor and link, tasks
    coloured by operator (legend at the right), copies dark grey, a simulation's launches light
    grey before their nodes, time in ms from the first event."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _colors([trace])
    title, span_ms, t0 = title or _default_title(trace), trace.span_us / 1e3, trace.start_us
    trace, left_out = busiest_rows(trace)
    fig = plt.figure(figsize=(WIDTH_PX / DPI, figure_height_px(len(trace.rows())) / DPI), dpi=DPI)
    ax = fig.add_axes(_axes_rect(0.0, 1.0, fig))
    _draw(ax, trace, colors, span_ms, title + left_out, t0)
    _legend(fig, colors, _used_keys([trace], colors))
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return path


def busiest_rows(trace: Trace, most: int = MOST_ROWS) -> tuple[Trace, str]:
    """`trace` with only the events of its `most` busiest tracks (by time in events) when it has
    more, and what a title adds to say so ('' when nothing is left out)."""
    rows = trace.rows()
    if len(rows) <= most:
        return trace, ""
    busy: dict[tuple, float] = defaultdict(float)
    for e in trace.events:
        busy[(e["rank"], e["proc"])] += e["end"] - e["start"]
    kept = set(sorted(rows, key=lambda row: -busy[row])[:most])
    events = [e for e in trace.events if (e["rank"], e["proc"]) in kept]
    return Trace(events, trace.meta), f" (the {most} busiest of {len(rows)} tracks)"


def _axes_rect(bottom: float, top: float, fig) -> list[float]:
    """Axes inside [bottom, top] of the figure, leaving fixed pixel margins for labels and the legend."""
    h = fig.get_figheight() * DPI
    pad_b, pad_t = 45 / h, 30 / h
    return [0.16, bottom + pad_b, 0.70, (top - bottom) - pad_b - pad_t]


def _default_title(trace: Trace) -> str:
    what = "simulated" if trace.simulated else "measured"
    return f"{what}: {len(trace.events)} events on ranks {trace.ranks}, {trace.span_us / 1e3:.3f} ms"


# ---- comparing a simulated iteration with a measured run ---------------------------------------
@dataclass(frozen=True)
class Iterations:
    """A measured run cut into its training iterations: on each rank, iteration k starts at the
    k-th start of the task that starts the simulated iteration there (the batch source in the
    apps), and holds the events that start from then until the next one."""

    marker: dict[int, str]          # rank -> the name of the task that starts an iteration there
    starts: dict[int, list[float]]  # rank -> each iteration's start (us)

    def __repr__(self) -> str:
        return f"Iterations({self.count} on ranks {sorted(self.starts)}, marked by {sorted(set(self.marker.values()))})"

    @property
    def count(self) -> int:
        return len(next(iter(self.starts.values()), []))

    def index(self, event: dict) -> int:
        """The iteration an event falls in; -1 before the first (the run's set-up)."""
        return bisect.bisect_right(self.starts[event["rank"]], event["start"]) - 1

    def times_us(self, measured: Trace) -> list[float]:
        """Each iteration's time: from when the last rank began it to when the last rank began the
        next (as an app times its loop: one step after another); the last to the run's last end.
        One boundary for all ranks: a rank's own gaps count the ranks' skew twice, once in each
        of two iterations, where a rank's batch source starts the next step before the others
        are done with this one (an 8-iteration mlp run on 2 ranks: 166 ms for a 71 ms step)."""
        bounds = [max(s[k] for s in self.starts.values()) for k in range(self.count)]
        bounds.append(max(e["end"] for e in measured.events))
        return [b - a for a, b in zip(bounds, bounds[1:])]


def cut_iterations(simulated: Trace, measured: Trace) -> Iterations | str:
    """The measured run's iterations (`Iterations`), or why it cannot be cut into them. On each
    rank the marker is the simulated iteration's first task in program order (node ids) that the
    run has too: the batch source in the apps (a model fed from arrays has none, and its first
    forward task marks it). The run's count of it must be a whole number of iterations, the
    same on every rank."""
    ran: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))   # rank -> name -> starts
    for e in measured.events:
        if is_task(e):
            ran[e["rank"]][e["name"]].append(e["start"])
    starts: dict[int, list[float]] = {}
    marker: dict[int, str] = {}
    for rank in measured.ranks:
        tasks = sorted((e for e in simulated.events if e["rank"] == rank and is_task(e) and e["name"] in ran[rank]),
                       key=lambda e: e["id"])
        if not tasks:
            return f"the simulated trace has no task on rank {rank} that the run has"
        name = marker[rank] = tasks[0]["name"]
        each = sum(e["name"] == name for e in tasks)
        seen = sorted(ran[rank][name])
        if len(seen) % each:
            return f"rank {rank} ran {len(seen)} {name!r} tasks, not a multiple of the {each} an iteration has"
        starts[rank] = seen[::each]
    counts = {len(s) for s in starts.values()}
    if len(counts) != 1:
        return f"the ranks ran different numbers of iterations: {sorted(counts)}"
    return Iterations(marker, starts)


def operator_phase(event: dict) -> str:
    """'fc1 backward', 'fc1 fill': a task's operator and phase (its operator alone for a task of no
    phase: the batch source, an attach)."""
    ph = phase(event)
    return operator(event) if ph == "task" else f"{operator(event)} {ph}"


#: the phases whose tasks are an op's tiles (or its weights' shards), in a run and a simulation
#: alike: where an op has other tiles in the two, they ran other strategies
TILED_PHASES = ("forward", "backward", "update")

#: compare's tables of task time: each name's key of a task event
TABLES = {"operators": operator, "phases": operator_phase, "processors": lambda e: e["proc"]}


def compare(simulated: Trace, measured: Trace, skip: int = 1) -> dict:
    """Predicted against measured times per iteration, with relative errors: the iteration's time,
    and task time per operator, per operator and phase, and per processor. The measured run is
    cut into its iterations (`cut_iterations`); the first `skip` are left out (the first compiles
    kernels and starts from the weights' attach), and each figure is the median over the rest,
    so a slow outlier does not move it. A run that cannot be cut is averaged over all its
    iterations (its task count over the simulated one's), which the result says
    ("per_iteration": false, "why")."""
    return _compared(simulated, measured, skip)[0]


def _compared(simulated: Trace, measured: Trace, skip: int) -> tuple[dict, Iterations | None]:
    """(`compare`'s result, the run's iterations where it could be cut, else None)."""
    if not simulated.simulated or measured.simulated:
        which = "a measured run" if not simulated.simulated else "a simulation"
        where = "first" if not simulated.simulated else "second"
        raise TraceError(f"compare: the {where} trace is {which}: give the simulated trace first (meta "
                         f"'simulated': true, as SimResult.write_trace writes it), then the measured run")
    if measured.ranks != simulated.ranks:
        raise TraceError(f"compare: the simulation has ranks {simulated.ranks}, the measured run {measured.ranks}: "
                         f"give every rank's file of the run (run.jsonl stands for run.rank0.jsonl, run.rank1.jsonl, "
                         f"...), of a run on as many ranks as the simulation")
    sim_tasks = [e for e in simulated.events if is_task(e)]
    sim_ops = {operator(e) for e in sim_tasks}
    absent = sorted(sim_ops - {operator(e) for e in measured.events if is_task(e)})
    if len(absent) > len(sim_ops) / 2:
        raise TraceError(f"compare: the traces look like runs of different models: {len(absent)} of the simulated "
                         f"trace's {len(sim_ops)} operators are not in the measured run "
                         f"({', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''})")
    cut = cut_iterations(simulated, measured)
    if isinstance(cut, str):
        return _compare_averaged(simulated, measured, sim_tasks, cut), None
    if not 0 <= skip < cut.count:
        raise TraceError(f"compare: cannot leave out {skip} iteration(s): the measured run has {cut.count}")
    kept = range(skip, cut.count)
    sums: dict[str, list[dict]] = {which: [defaultdict(float) for _ in kept] for which in TABLES}
    totals = [0.0 for _ in kept]
    for e in filter(is_task, measured.events):
        k = cut.index(e) - skip
        if k >= 0:
            dur = e["end"] - e["start"]
            for which, key in TABLES.items():
                sums[which][k][key(e)] += dur
            totals[k] += dur
    times = cut.times_us(measured)[skip:]

    def table(which) -> list[dict]:
        sim: dict[str, float] = defaultdict(float)
        for e in sim_tasks:
            sim[TABLES[which](e)] += e["end"] - e["start"]
        names = set(sim).union(*sums[which])
        rows = [_row(k, sim.get(k, 0.0), _median([s.get(k, 0.0) for s in sums[which]])) for k in names]
        return sorted(rows, key=lambda r: -max(r["simulated_us"], r["measured_us"]))

    sim_total = sum(e["end"] - e["start"] for e in sim_tasks)
    median = _median(times)
    median_k = skip + min(range(len(times)), key=lambda i: (abs(times[i] - median), i))
    return {"iterations": cut.count, "skipped": skip, "per_iteration": True, "median_iteration": median_k,
            "tiles_differ": _tiles_differ(sim_tasks, measured),
            "iteration": {**_row(None, simulated.span_us, median), "measured_min_us": min(times),
                          "measured_max_us": max(times), "measured_each_us": times},
            "task_time": _row(None, sim_total, _median(totals)), "task_wait": _wait_row(simulated, measured, skip),
            **{which: table(which) for which in TABLES}}, cut


def _compare_averaged(simulated: Trace, measured: Trace, sim_tasks: list[dict], why: str) -> dict:
    """`compare` for a run that cannot be cut into iterations: its totals over its iteration count."""
    meas_tasks = [e for e in measured.events if is_task(e)]
    iterations = max(1, round(len(meas_tasks) / max(1, len(sim_tasks))))

    def table(key) -> list[dict]:
        sim: dict[str, float] = defaultdict(float)
        meas: dict[str, float] = defaultdict(float)
        for e in sim_tasks:
            sim[key(e)] += e["end"] - e["start"]
        for e in meas_tasks:
            meas[key(e)] += (e["end"] - e["start"]) / iterations
        rows = [_row(k, sim.get(k, 0.0), meas.get(k, 0.0)) for k in set(sim) | set(meas)]
        return sorted(rows, key=lambda r: -max(r["simulated_us"], r["measured_us"]))

    sim_total = sum(e["end"] - e["start"] for e in sim_tasks)
    meas_total = sum(e["end"] - e["start"] for e in meas_tasks) / iterations
    return {"iterations": iterations, "skipped": 0, "per_iteration": False, "why": why,
            "tiles_differ": _tiles_differ(sim_tasks, measured),
            "iteration": _row(None, simulated.span_us, measured.span_us / iterations),
            "task_time": _row(None, sim_total, meas_total), "task_wait": _wait_row(simulated, measured, 0),
            **{which: table(key) for which, key in TABLES.items()}}


def _tiles_differ(sim_tasks: list[dict], measured: Trace) -> list[dict]:
    """The operator phases (of TILED_PHASES) whose tiles (the distinct points of their tasks) differ
    between the simulation and the run, with their counts: the two ran other strategies (the run
    is then cut into iterations wrongly, too, by the simulation's first task). Points, not task
    counts, so that it does not depend on the cut; and the points themselves, so that 1x2 and 2x1
    tiles differ."""
    def tiles(events) -> dict[str, set]:
        out: dict[str, set] = defaultdict(set)
        for e in events:
            if is_task(e) and phase(e) in TILED_PHASES:
                out[operator_phase(e)].add(tuple(e.get("point") or ()))
        return out

    sim, run = tiles(sim_tasks), tiles(measured.events)
    return [{"name": k, "simulated": len(sim.get(k, ())), "measured": len(run.get(k, ()))}
            for k in sorted(set(sim) | set(run)) if sim.get(k, set()) != run.get(k, set())]


def _wait_row(simulated: Trace, measured: Trace, skip: int) -> dict | None:
    """The mean wait of a task that found its processor idle (`waits`; the run's first `skip`
    runs of each task left out), simulated (the model's launch, and message handling) against
    measured (the runtime's hand-off); None where a trace cannot tell (no preds, no such task)."""
    try:
        return _row(None, waits(simulated)["wait_us"]["mean"], waits(measured, skip=skip)["wait_us"]["mean"])
    except TraceError:
        return None


def _row(name: str | None, simulated_us: float, measured_us: float) -> dict:
    row = {"simulated_us": simulated_us, "measured_us": measured_us, "error": _rel(simulated_us, measured_us)}
    return row if name is None else {"name": name, **row}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _rel(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def format_compare(c: dict) -> str:
    def err(x):
        return "-" if x is None else f"{x:+.0%}"

    it, tt = c["iteration"], c["task_time"]
    if c["per_iteration"]:
        head = (f"measured run: {c['iterations']} iterations, the first {c['skipped']} left out; medians of the "
                f"other {c['iterations'] - c['skipped']} (iteration {it['measured_min_us'] / 1e3:.3f}-"
                f"{it['measured_max_us'] / 1e3:.3f} ms), simulated against measured:")
    else:
        head = (f"measured run: not cut into iterations ({c['why']}); its totals over {c['iterations']} "
                f"iteration(s), simulated against measured:")
    lines = [head,
             f"iteration time {it['simulated_us'] / 1e3:.3f} ms vs {it['measured_us'] / 1e3:.3f} ms ({err(it['error'])}); "
             f"task time {tt['simulated_us'] / 1e3:.3f} ms vs {tt['measured_us'] / 1e3:.3f} ms ({err(tt['error'])})"]
    w = c["task_wait"]
    if w is not None:
        lines.append(f"a task's wait for its idle processor (mean) {w['simulated_us']:.1f} us vs "
                     f"{w['measured_us']:.1f} us ({err(w['error'])})")
    differ = c.get("tiles_differ")
    if differ:
        first = differ[0]
        lines.append(f"the two ran other strategies, it seems: {len(differ)} operator phase(s) have other tiles "
                     f"({first['name']}: {first['simulated']} simulated, {first['measured']} measured)")
    for title, rows in (("operator", c["operators"]), ("operator and phase", c["phases"]),
                        ("processor", c["processors"])):
        lines += ["", f"{title:<30}{'simulated ms':>14}{'measured ms':>13}{'error':>8}"]
        for r in rows:
            lines.append(f"{r['name']:<30}{r['simulated_us'] / 1e3:>14.3f}{r['measured_us'] / 1e3:>13.3f}"
                         f"{err(r['error']):>8}")
    return "\n".join(lines)


def write_compare(simulated: Trace, measured: Trace, path: str, skip: int = 1) -> dict:
    """Both timelines in one PNG on one time scale, one legend: the simulated iteration above and,
    below, the measured iteration whose time is the nearest to the median (the whole run where it cannot be cut
    into iterations); and the comparison table (`compare`), which it returns."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result, cut = _compared(simulated, measured, skip)
    if cut is not None:
        k = result["median_iteration"]
        shown = Trace([e for e in measured.events if cut.index(e) == k], measured.meta)
        took = result["iteration"]["measured_each_us"][k - skip]
        median = result["iteration"]["measured_us"]
        which = "the median" if took == median else f"the nearest to the median, {median / 1e3:.3f} ms"
        title = f"measured: iteration {k + 1} of {result['iterations']} ({which}), {took / 1e3:.3f} ms"
        xmax = max(simulated.span_us, shown.span_us) / 1e3
        xmax_measured = xmax
    else:
        shown = measured
        title = f"measured: {measured.span_us / 1e3:.3f} ms for {result['iterations']} iteration(s)"
        xmax = max(simulated.span_us, measured.span_us / result["iterations"]) / 1e3
        xmax_measured = measured.span_us / 1e3 if result["iterations"] == 1 else xmax * result["iterations"]
    colors = _colors([simulated, shown])
    span_s, t0_s, t0_m = simulated.span_us, simulated.start_us, shown.start_us
    (simulated, left_s), (shown, left_m) = busiest_rows(simulated), busiest_rows(shown)
    rs, rm = len(simulated.rows()), len(shown.rows())
    height = 2 * MARGIN_PX + ROW_PX * (max(rs, 1) + max(rm, 1))
    fig = plt.figure(figsize=(WIDTH_PX / DPI, height / DPI), dpi=DPI)
    split = 1.0 - (MARGIN_PX + ROW_PX * max(rs, 1)) / height
    ax_s = fig.add_axes(_axes_rect(split, 1.0, fig))
    ax_m = fig.add_axes(_axes_rect(0.0, split, fig))
    _draw(ax_s, simulated, colors, xmax, f"simulated: {span_s / 1e3:.3f} ms an iteration{left_s}", t0_s)
    _draw(ax_m, shown, colors, xmax_measured, title + left_m, t0_m)
    _legend(fig, colors, _used_keys([simulated, shown], colors))
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return result


# ---- command line ----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = LineParser(prog="python -m tools.trace", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=LineParser)
    m = sub.add_parser("merge", help="per-rank traces into one file, on one clock")
    m.add_argument("traces", nargs="+")
    m.add_argument("-o", "--output", required=True)
    c = sub.add_parser("chrome", help="export for Perfetto / chrome://tracing")
    c.add_argument("traces", nargs="+")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--flows", type=int, action="append", metavar="ID", help="draw the dependences of node ID")
    t = sub.add_parser("timeline", help="a PNG, one row per processor and link")
    t.add_argument("traces", nargs="+")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--title")
    s = sub.add_parser("summary", help="busy, copy and idle time per processor; top operators; ranks")
    s.add_argument("traces", nargs="+")
    s.add_argument("--json", action="store_true")
    s.add_argument("--top", type=_count_from(1), default=10, metavar="N", help="the operators listed")
    k = sub.add_parser("critical-path", help="the chain of tasks and copies that sets the time")
    k.add_argument("traces", nargs="+")
    k.add_argument("--json", action="store_true")
    g = sub.add_parser("messages", help="how long messages between ranks were in flight")
    g.add_argument("traces", nargs="+")
    g.add_argument("--json", action="store_true")
    w = sub.add_parser("waits", help="how long tasks waited to start on an idle processor")
    w.add_argument("traces", nargs="+")
    w.add_argument("--json", action="store_true")
    w.add_argument("--top", type=_count_from(0), default=10, help="the longest waits listed (default: %(default)s)")
    w.add_argument("--skip", type=_count_from(0), default=0, metavar="N",
                   help="leave out each task's first N runs (1: a training run's first iteration; default: 0)")
    q = sub.add_parser("compare", help="a simulated trace against a measured one")
    q.add_argument("simulated")
    q.add_argument("measured", nargs="+")
    q.add_argument("-o", "--output", required=True)
    q.add_argument("--json", action="store_true")
    q.add_argument("--skip", type=_count_from(0), default=1, metavar="N",
                   help="measured iterations left out first (default: 1, the one that compiles kernels)")
    return p


def _count_from(least: int):
    """An argparse type: a whole number >= least."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {least}")
        return n
    return parse


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except TraceError as e:
        print(f"tools.trace: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:
            raise
        print(f"tools.trace: {e.filename}: cannot write: {e.strerror}", file=sys.stderr)
        return 2


def _run(args) -> int:
    output = getattr(args, "output", None)
    problem = None if output is None else output_problem(output)   # (before the traces are read)
    if problem is None and args.command in ("timeline", "compare"):
        problem = png_problem(output)
    if problem is not None:
        raise TraceError(f"-o {output}: {problem}")
    if args.command == "compare":
        result = write_compare(load(args.simulated), load(args.measured), args.output, args.skip)
        print(json.dumps(result, indent=1) if args.json else format_compare(result) + f"\nwrote {args.output}")
        return 0
    trace = load(args.traces)
    if args.command == "merge":
        write_merged(trace, args.output)
        print(f"wrote {args.output}: {len(trace.events)} events of ranks {trace.ranks}")
    elif args.command == "chrome":
        write_chrome(trace, args.output, flows_for=args.flows)
        print(f"wrote {args.output}")
    elif args.command == "timeline":
        write_timeline(trace, args.output, args.title)
        print(f"wrote {args.output}")
    elif args.command == "summary":
        s = summary(trace, args.top)
        print(json.dumps(s, indent=1) if args.json else format_summary(s))
    elif args.command == "critical-path":
        path = critical_path(trace)
        print(json.dumps(path, indent=1) if args.json else format_critical_path(path, trace.span_us))
    elif args.command == "messages":
        m = messages(trace)
        print(json.dumps(m, indent=1) if args.json else format_messages(m))
    elif args.command == "waits":
        w = waits(trace, args.top, args.skip)
        print(json.dumps(w, indent=1) if args.json else format_waits(w))
    return 0


if __name__ == "__main__":
    exit_with(main)
