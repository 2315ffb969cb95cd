"""What one rank does with each node of the task graph that every rank builds.

`route(node, rank)` is a pure function of the node and the rank:

- LOCAL: a task on one of this rank's processors, a copy between its memories: the
  executor runs it;
- SEND / RECV: a copy or fold from here to another rank / from another rank to here: this
  rank runs its half (taskrt/mpi_copies.py);
- REMOTE: everything else, fences (tasks that run nothing) included, on every rank. It is
  not run here, but may carry ordering that local nodes need: a local writer W may reach
  a local send only through a remote reader R (W -WAR-> R -> copy).

So a Router replaces each pred by its local frontier: a local pred (unfinished in the
executor) stays; a remote pred stands for the unfinished local nodes it waited for through
remote nodes. A remote node that stands for more than FRONTIER_MAX of them becomes an
executor Join with its id instead (a merged event), so that frontiers stay small however
far ahead of the run the program issues. Copies between ranks a -> b are numbered in graph
order on both sides: `sends_to[b]` on a, `recvs_from[a]` on b.

A reissued program block (taskrt/replay.py) is routed once per recording instead of node
by node: `route_rows` works out, from the block's rows alone, which rows this rank submits
and what each waits for locally (its preds, with remote ones replaced by the local rows they
stand for, and whether it waits for the block's fence), each copy's number among the
block's copies with its peer, and the frontier of every remote row that stands for local
ones. Those frontiers hold every local row a remote one reaches, finished or not: a superset
of what `stand_in` keeps, and so the same order.

State (a Router's, main thread only, no lock): `frontier` (remote id -> unfinished local
ids), `sends_to`, `recvs_from`, and the sweep counters. The executor's unfinished nodes
are passed in (`unfinished`, anything with `in`), so this module needs neither MPI nor an
executor.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .taskgraph import TaskNode

#: a remote node standing for more unfinished local nodes than this becomes a Join
FRONTIER_MAX = 4
#: frontiers are swept of finished nodes after this many new ones (or twice the live ones)
SWEEP_MIN = 4096


class Route(enum.Enum):
    """What a rank does with a node."""

    LOCAL = "local"
    SEND = "send"
    RECV = "recv"
    REMOTE = "remote"
    #: a remote node standing for more than FRONTIER_MAX local ones: an executor Join with its id
    JOIN = "join"


def route(node, rank: int) -> Route:
    """What `rank` does with `node` (a TaskNode or a CopyNode)."""
    if type(node) is TaskNode:
        if node.fn is not None and node.proc.rank == rank:
            return Route.LOCAL
        return Route.REMOTE
    src, dst = node.src.rank, node.dst.rank
    if src == dst:
        return Route.LOCAL if dst == rank else Route.REMOTE
    if src == rank:
        return Route.SEND
    if dst == rank:
        return Route.RECV
    return Route.REMOTE


@dataclass(frozen=True)
class RoutedRows:
    """How one rank submits a program block's rows (see `route_rows`). `submitted`: per row
    this rank's executor gets, in order, (row, route, the local rows it waits for, whether it
    waits for the fence, the copy's number among the block's copies with its peer (-1 for
    others)). `frontiers`: per remote row that stands for local ones, (row, those rows, whether
    the fence's frontier counts too). `sends` / `recvs`: the block's copies to / from each peer."""

    submitted: tuple
    frontiers: tuple
    sends: tuple[int, ...]
    recvs: tuple[int, ...]


def route_rows(rows, rank: int, size: int) -> RoutedRows:
    """Route a program block's rows (node, preds as row offsets, waits for the fence, ...) for
    `rank` of `size` ranks, as `Router` would route them node by node."""
    submitted, frontiers = [], []
    local_rows: set[int] = set()
    stands_for: dict[int, tuple[frozenset, bool]] = {}
    sends, recvs = [0] * size, [0] * size
    for i, (node, inner, external, _, _) in enumerate(rows):
        local, fence = set(), bool(external)
        for j in inner:
            if j in local_rows:
                local.add(j)
            elif j in stands_for:
                more, more_fence = stands_for[j]
                local |= more
                fence |= more_fence
        how = route(node, rank)
        if how is Route.REMOTE:
            if len(local) + fence <= FRONTIER_MAX:
                if local or fence:
                    stands_for[i] = (frozenset(local), fence)
                    frontiers.append((i, tuple(sorted(local)), fence))
                continue
            how = Route.JOIN
        seq = -1
        if how is Route.SEND:
            seq, sends[node.dst.rank] = sends[node.dst.rank], sends[node.dst.rank] + 1
        elif how is Route.RECV:
            seq, recvs[node.src.rank] = recvs[node.src.rank], recvs[node.src.rank] + 1
        local_rows.add(i)
        submitted.append((i, how, tuple(sorted(local)), fence, seq))
    return RoutedRows(tuple(submitted), tuple(frontiers), tuple(sends), tuple(recvs))


class Router:
    """One rank's frontiers of remote nodes and its copy counters (see the module doc)."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.frontier: dict[int, set] = {}
        self.sends_to = [0] * size
        self.recvs_from = [0] * size
        self._remembered = 0
        self._sweep_at = SWEEP_MIN

    def __repr__(self) -> str:
        return f"Router(rank {self.rank}, {len(self.frontier)} frontiers)"

    def next_send(self, peer: int) -> int:
        """The number of this rank's next copy to `peer`."""
        seq = self.sends_to[peer]
        self.sends_to[peer] = seq + 1
        return seq

    def next_recv(self, peer: int) -> int:
        """The number of this rank's next copy from `peer`."""
        seq = self.recvs_from[peer]
        self.recvs_from[peer] = seq + 1
        return seq

    def localize(self, preds, unfinished) -> list:
        """Local preds stay; a remote pred becomes the local nodes it still waits for."""
        frontier = self.frontier
        out = []
        for p in preds:
            if p in unfinished:
                out.append(p)
            else:
                f = frontier.get(p)
                if f is not None:
                    out.extend(f)
        return out

    def stand_in(self, node_id: int, local_preds: list, unfinished) -> set | None:
        """Remote node `node_id` waits for `local_preds`: note the unfinished ones as its
        frontier, or, past FRONTIER_MAX, return them: the caller makes a Join with the
        node's id that waits for them. A chain of remote nodes issued ahead of the run would
        otherwise carry every frontier before it into the next (a frontier growing with the
        program, and quadratic work)."""
        if not local_preds:
            return None
        live = {p for p in local_preds if p in unfinished}
        if len(live) > FRONTIER_MAX:
            return live
        if live:
            self.frontier[node_id] = live
            self._remembered += 1
            if self._remembered >= self._sweep_at:
                self.sweep(unfinished)
        return None

    def take_block(self, routed: RoutedRows, base: int, fence_local: tuple, unfinished) -> tuple[list, list]:
        """A reissued block's rows numbered from `base` (RoutedRows): note its remote rows'
        frontiers (with `fence_local`, what the fence stands for, where they reach it) and
        count its copies; the first copy numbers to and from each peer."""
        fence_set = set(fence_local)
        frontier = self.frontier
        for i, rows, fence in routed.frontiers:
            f = {base + j for j in rows}
            frontier[base + i] = f | fence_set if fence else f
        first_sends, first_recvs = list(self.sends_to), list(self.recvs_from)
        self.sends_to = [a + b for a, b in zip(self.sends_to, routed.sends)]
        self.recvs_from = [a + b for a, b in zip(self.recvs_from, routed.recvs)]
        self._remembered += len(routed.frontiers)
        if self._remembered >= self._sweep_at:
            self.sweep(unfinished)
        return first_sends, first_recvs

    def sweep(self, unfinished) -> None:
        """Forget remote nodes whose local ancestors have all finished."""
        for nid, f in list(self.frontier.items()):
            live = {p for p in f if p in unfinished}
            if live:
                self.frontier[nid] = live
            else:
                del self.frontier[nid]
        self._remembered = 0
        self._sweep_at = max(SWEEP_MIN, 2 * len(self.frontier))

    def is_done(self, node_id: int, unfinished) -> bool:
        """Done as far as this rank can tell: a remote node is done once its local ancestors are."""
        if node_id in unfinished:
            return False
        f = self.frontier.get(node_id)
        if f is None:
            return True
        if any(p in unfinished for p in f):
            return False
        self.frontier.pop(node_id, None)
        return True
