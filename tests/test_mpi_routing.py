"""Routing without MPI (taskrt/mpi_routing.py): what each rank does with a node, the copy
numbers both sides of a copy agree on, and the frontiers and Joins that stand for remote
nodes, checked against a reference that walks the graph. Nothing here imports mpi4py."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from taskrt import Machine, Region
from taskrt.geometry import Rect
from taskrt.mpi_routing import FRONTIER_MAX, SWEEP_MIN, Route, Router, route, route_rows
from taskrt.taskgraph import CopyNode, TaskNode

MACHINE = Machine.build(3, cpus_per_rank=2, separate_memories=True)
REGION = Region((8,), "float64", "x")


def work():
    """A task function: routing never runs it."""


def task(node_id: int, proc, fn=work) -> TaskNode:
    return TaskNode(node_id, f"t{node_id}", proc, fn, ())


def copy(node_id: int, src, dst) -> CopyNode:
    return CopyNode(node_id, REGION, Rect((0,), (8,)), src, dst)


def test_a_task_runs_on_its_own_rank_only_and_a_fence_on_none():
    for proc in MACHINE.processors:
        for rank in range(MACHINE.num_ranks):
            want = Route.LOCAL if proc.rank == rank else Route.REMOTE
            assert route(task(0, proc), rank) is want, (proc, rank)
            assert route(task(0, proc, fn=None), rank) is Route.REMOTE, f"a fence on {proc} runs on rank {rank}"


@given(st.sampled_from(MACHINE.memories), st.sampled_from(MACHINE.memories))
def test_a_copy_is_run_by_one_rank_or_split_into_one_send_and_one_receive(src, dst):
    routes = {rank: route(copy(0, src, dst), rank) for rank in range(MACHINE.num_ranks)}
    if src.rank == dst.rank:
        want = {r: Route.LOCAL if r == src.rank else Route.REMOTE for r in routes}
    else:
        want = {r: Route.SEND if r == src.rank else Route.RECV if r == dst.rank else Route.REMOTE for r in routes}
    assert routes == want, f"{src} -> {dst}"


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=40))
def test_both_ranks_of_a_copy_give_it_the_same_number(pairs):
    """Every rank counts the copies to and from each peer in graph order, so a send and its
    receive get the same number (and so the same tag)."""
    routers = [Router(r, 3) for r in range(3)]
    counts: dict[tuple[int, int], int] = {}
    for src, dst in pairs:
        if src == dst:
            continue
        sent, received = routers[src].next_send(dst), routers[dst].next_recv(src)
        assert sent == received == counts.get((src, dst), 0), f"copy {src} -> {dst}"
        counts[(src, dst)] = sent + 1


def test_a_remote_node_standing_for_more_than_frontier_max_local_nodes_becomes_a_join():
    router = Router(0, 2)
    unfinished = set(range(FRONTIER_MAX + 1))
    few = list(range(FRONTIER_MAX))
    assert router.stand_in(100, few, unfinished) is None
    assert router.frontier[100] == set(few)
    assert router.localize([100], unfinished) == few
    many = list(range(FRONTIER_MAX + 1))
    assert router.stand_in(101, many + many, unfinished) == set(many), "a Join waits for the unfinished preds"
    assert 101 not in router.frontier, "a node that became a Join keeps no frontier"


def test_a_chain_of_remote_nodes_issued_ahead_keeps_every_wait_small():
    """Remote node R_i waits for R_(i-1) and a new local node L_i, nothing finishes: without
    Joins R_i would stand for every L before it."""
    me = Rank(0)
    remote, local = MACHINE.processors[-1], MACHINE.processors[0]
    for i in range(1000):
        me.issue(task(2 * i, local), [])
        me.issue(task(2 * i + 1, remote), [2 * i - 1, 2 * i] if i else [0])
    assert max(len(w) for w in me.waits.values()) <= FRONTIER_MAX + 1
    assert me.expand(me.waits[1999]) == set(range(0, 2000, 2)), "the last remote node stands for every local one"
    assert len(me.joins) >= 1000 // (FRONTIER_MAX + 1)


def test_finished_preds_are_not_remembered_and_a_node_with_none_left_is_done():
    router = Router(0, 2)
    assert router.stand_in(10, [1, 2], unfinished={2}) is None
    assert router.frontier == {10: {2}}
    assert not router.is_done(10, unfinished={2})
    assert router.is_done(10, unfinished=set()) and 10 not in router.frontier
    assert router.stand_in(11, [1], unfinished=set()) is None and 11 not in router.frontier
    assert router.is_done(11, unfinished=set())


def test_frontiers_are_swept_of_finished_nodes():
    router = Router(0, 2)
    unfinished = set(range(SWEEP_MIN))
    for i in range(SWEEP_MIN - 1):
        router.stand_in(SWEEP_MIN + i, [i], unfinished)
    unfinished -= set(range(SWEEP_MIN - 1))
    assert len(router.frontier) == SWEEP_MIN - 1
    router.stand_in(2 * SWEEP_MIN, [SWEEP_MIN - 1], unfinished)
    assert router.frontier == {2 * SWEEP_MIN: {SWEEP_MIN - 1}}, "the sweep kept frontiers of finished nodes"


# ---- frontiers against a reference -------------------------------------------------------------
@st.composite
def graphs(draw):
    """(nodes, preds): tasks and copies on a 3-rank machine, each waiting for some earlier ones."""
    n = draw(st.integers(1, 40))
    nodes, preds = [], {}
    for i in range(n):
        if draw(st.booleans()):
            nodes.append(task(i, draw(st.sampled_from(MACHINE.processors)),
                              fn=draw(st.sampled_from([work, work, work, None]))))
        else:
            nodes.append(copy(i, draw(st.sampled_from(MACHINE.memories)), draw(st.sampled_from(MACHINE.memories))))
        preds[i] = draw(st.lists(st.integers(0, i - 1), max_size=8)) if i else []
    return nodes, preds


class Rank:
    """One rank issuing a graph as MPITransport.submit does, against a stand-in executor that
    holds what is unfinished (local nodes and Joins) and what each waits for."""

    def __init__(self, rank: int):
        self.router = Router(rank, MACHINE.num_ranks)
        self.unfinished: set[int] = set()
        self.waits: dict[int, list[int]] = {}
        self.joins: dict[int, set[int]] = {}
        self.local: set[int] = set()

    def issue(self, node, preds) -> None:
        waits = self.router.localize(preds, self.unfinished)
        self.waits[node.id] = waits
        if route(node, self.router.rank) is Route.REMOTE:
            join = self.router.stand_in(node.id, waits, self.unfinished)
            if join is not None:
                self.joins[node.id] = join
                self.unfinished.add(node.id)
        else:
            self.local.add(node.id)
            self.unfinished.add(node.id)

    def finish(self, node_id: int) -> None:
        """Finish a local node whose preds have finished, then every Join that it frees."""
        assert not any(p in self.unfinished for p in self.waits[node_id])
        self.unfinished.discard(node_id)
        while True:
            freed = [j for j in self.joins if j in self.unfinished and not self.joins[j] & self.unfinished]
            if not freed:
                return
            self.unfinished.difference_update(freed)

    def ready(self) -> list[int]:
        return sorted(n for n in self.local & self.unfinished if not any(p in self.unfinished for p in self.waits[n]))

    def expand(self, ids) -> set[int]:
        """Local nodes that `ids` stand for (a Join stands for what it waits for)."""
        out = set()
        for i in ids:
            out |= self.expand(self.joins[i]) if i in self.joins else {i}
        return out


def nearest_local(node_id: int, preds, local: set[int], memo: dict) -> set[int]:
    """The reference: local nodes that `node_id` reaches through remote nodes only."""
    if node_id not in memo:
        out = set()
        for p in preds[node_id]:
            out |= {p} if p in local else nearest_local(p, preds, local, memo)
        memo[node_id] = out
    return memo[node_id]


@settings(max_examples=200)
@given(graphs(), st.integers(0, 2))
def test_with_nothing_finished_a_node_waits_for_exactly_its_nearest_local_ancestors(graph, rank):
    nodes, preds = graph
    me = Rank(rank)
    for node in nodes:
        me.issue(node, preds[node.id])
    memo: dict = {}
    for node in nodes:
        want = nearest_local(node.id, preds, me.local, memo)
        assert me.expand(me.waits[node.id]) == want, f"node #{node.id} on rank {rank}"
        if node.id in me.joins:
            assert len(set(me.waits[node.id])) > FRONTIER_MAX
    assert all(len(f) <= FRONTIER_MAX for f in me.router.frontier.values())
    assert not set(me.router.frontier) & set(me.joins)


@settings(max_examples=100)
@given(graphs(), st.integers(0, 2), st.data())
def test_as_nodes_finish_every_unfinished_ancestor_is_still_waited_for(graph, rank, data):
    """Local nodes finish in any order their preds allow, between issues and sweeps: a
    node still waits for each nearest local ancestor that has not finished, and a remote
    node is done exactly when all of them have."""
    nodes, preds = graph
    me = Rank(rank)
    memo: dict = {}
    for node in nodes:
        for _ in range(data.draw(st.integers(0, 3), label="finishes")):
            ready = me.ready()
            if ready:
                me.finish(data.draw(st.sampled_from(ready), label="finish"))
        if data.draw(st.booleans(), label="sweep"):
            me.router.sweep(me.unfinished)
        me.issue(node, preds[node.id])
        want = nearest_local(node.id, preds, me.local, memo)
        assert want & me.unfinished <= me.expand(me.waits[node.id]), f"node #{node.id} on rank {rank}"
        for n in nodes[:node.id + 1]:
            if n.id in me.local:
                assert me.router.is_done(n.id, me.unfinished) == (n.id not in me.unfinished)
            else:
                ancestors = nearest_local(n.id, preds, me.local, memo)
                assert me.router.is_done(n.id, me.unfinished) == (not ancestors & me.unfinished), \
                    f"remote node #{n.id} on rank {rank}"


@settings(max_examples=200)
@given(graphs(), st.integers(0, 2), st.data())
def test_routed_rows_wait_for_the_nearest_local_ancestors_and_number_copies_in_order(graph, rank, data):
    """route_rows on a program block's rows (some waiting for the block's fence): every row the
    rank submits waits for exactly its nearest local ancestors (the fence standing for a local
    node), every remote row's frontier names exactly its own, and copies are numbered per peer
    in row order, as node-by-node routing numbers them."""
    nodes, preds = graph
    external = {node.id: data.draw(st.booleans()) for node in nodes}
    routed = route_rows([(node, tuple(preds[node.id]), external[node.id], 0, 0) for node in nodes], rank,
                        MACHINE.num_ranks)
    fence = -1
    ref_preds = {fence: [], **{n.id: preds[n.id] + ([fence] if external[n.id] else []) for n in nodes}}
    local = {n.id for n in nodes if route(n, rank) is not Route.REMOTE} | {fence}
    joins = {i: (waits, waits_fence) for i, how, waits, waits_fence, _ in routed.submitted if how is Route.JOIN}

    def expand(waits, waits_fence) -> set[int]:
        out = {fence} if waits_fence else set()
        for j in waits:
            out |= expand(*joins[j]) if j in joins else {j}
        return out

    memo: dict = {}
    stands_for = {i: (waits, waits_fence) for i, waits, waits_fence in routed.frontiers}
    for node in nodes:
        want = nearest_local(node.id, ref_preds, local, memo)
        if route(node, rank) is not Route.REMOTE:
            continue
        if node.id in joins:
            assert len(joins[node.id][0]) + joins[node.id][1] > FRONTIER_MAX
            assert expand(*joins[node.id]) == want, f"join #{node.id} on rank {rank}"
        elif want:
            assert expand(*stands_for[node.id]) == want, f"remote #{node.id} on rank {rank}"
        else:
            assert node.id not in stands_for
    router = Router(rank, MACHINE.num_ranks)
    submitted = [i for i, *_ in routed.submitted]
    assert submitted == sorted((local - {fence}) | set(joins))
    for i, how, waits, waits_fence, seq in routed.submitted:
        assert how is (Route.JOIN if i in joins else route(nodes[i], rank))
        if how is not Route.JOIN:
            assert expand(waits, waits_fence) == nearest_local(i, ref_preds, local, memo), f"#{i} on rank {rank}"
        if how is Route.SEND:
            assert seq == router.next_send(nodes[i].dst.rank)
        elif how is Route.RECV:
            assert seq == router.next_recv(nodes[i].src.rank)
        else:
            assert seq == -1
    assert list(routed.sends) == router.sends_to and list(routed.recvs) == router.recvs_from


def test_a_taken_block_notes_its_remote_rows_frontiers_and_counts_its_copies():
    """Rows numbered from base: a remote row's frontier is its local rows (and the fence's local
    nodes where it reaches the fence); copy numbers go on from where the router stood."""
    local, remote = MACHINE.processors[0], MACHINE.processors[-1]
    other = next(m for m in MACHINE.memories if m.rank == 1)
    rows = [(task(0, local), (), True, 0, 0), (task(1, remote), (0,), False, 0, 0),
            (task(2, remote), (), True, 0, 0), (copy(3, local.memory, other), (0,), False, 0, 0)]
    router = Router(0, MACHINE.num_ranks)
    router.next_send(1)
    routed = route_rows(rows, 0, MACHINE.num_ranks)
    first_sends, _ = router.take_block(routed, 100, (7, 8), unfinished={100, 103, 7, 8})
    assert router.frontier == {101: {100}, 102: {7, 8}}
    assert first_sends[1] == 1 and router.sends_to[1] == 2
    assert sorted(router.localize([101, 102], {100, 7, 8})) == [7, 8, 100]
    assert not router.is_done(101, {100}) and router.is_done(101, set())
