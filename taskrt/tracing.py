"""Trace events: one per task and copy, written as JSON lines (format in README.md)."""
from __future__ import annotations

import json
import time

from .taskgraph import TaskNode


def rank_trace_path(path: str, rank: int) -> str:
    """Where rank `rank` of a multi-rank run writes the trace named `path`:
    run.jsonl -> run.rank3.jsonl, run -> run.rank3.jsonl."""
    base = path[:-len(".jsonl")] if path.endswith(".jsonl") else path
    return f"{base}.rank{rank}.jsonl"


class TraceRecorder:
    """An executor hook keeping each node's facts and times as a small tuple; `write` makes JSON lines.

    Times are microseconds since `origin` plus `clock_offset`; on many ranks the MPI
    transport sets the offset at start-up so that every rank's times count from rank 0's
    origin (ping-pongs against rank 0, minimum round trip kept; `clock_sync` in the meta)."""

    def __init__(self, rank: int = 0, clock_offset: float = 0.0):
        self.rank = rank
        self.origin = time.perf_counter()
        self.wall_origin = time.time()
        self.clock_offset = clock_offset
        self.meta: dict = {}
        self.events: list[tuple] = []
        #: node id -> the ids it waits for, noted when the node is made (the graph's edges, so the
        #: trace tools find real dependences: critical paths, flow arrows)
        self.preds: dict[int, tuple] = {}

    def __call__(self, node, start: float, end: float) -> None:
        # keep the facts, not the node: a node holds its task's arguments (arrays, say)
        if type(node) is TaskNode:
            self.events.append((node.id, node.name, node.kind, node.op, node.proc, None, start, end, node.nbytes,
                                node.point))
        else:
            self.events.append((node.id, node.name, node.kind, node.op, node.src, node.dst, start, end, node.nbytes,
                                None))

    def records(self):
        """The events as dicts, one at a time (the file format of README.md)."""
        for nid, name, kind, op, where, dst, start, end, nbytes, point in self.events:
            yield {
                "id": nid,
                "name": name,
                "kind": kind,
                "op": op,
                "rank": self.rank,
                "proc": str(where) if dst is None else f"{where}->{dst}",
                "start": round((start - self.origin) * 1e6 + self.clock_offset, 3),
                "end": round((end - self.origin) * 1e6 + self.clock_offset, 3),
                "bytes": nbytes,
                "point": None if point is None else list(point),
                "preds": list(self.preds.get(nid, ())),
            }

    def write(self, path: str) -> None:
        meta = {"kind": "meta", "rank": self.rank, "wall_origin": self.wall_origin,
                "clock_offset_us": self.clock_offset, "unit": "us", "events": len(self.events), **self.meta}
        with open(path, "w") as f:
            f.write(json.dumps(meta) + "\n")
            for rec in self.records():
                f.write(json.dumps(rec) + "\n")


def read_trace(path: str) -> tuple[dict, list[dict]]:
    """(meta, events) of a trace file."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    meta = lines[0] if lines and lines[0].get("kind") == "meta" else {}
    return meta, [e for e in lines if e.get("kind") != "meta"]
