"""MCMC search on simulated time: reproducible, never worse than the baselines, memory-aware."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.model import Model
from strategies.cost import CostModel
from strategies.machine_model import load_machine
from strategies.search import search
from strategies.simulator import Simulator
from taskrt import Runtime


def mlp():
    m = Model(Runtime(execute=False), weights=False)
    x = m.input((32, 64), name="x")
    m.dense(m.dense(x, 64, activation="relu"), 8)
    return m


def simulator(model, mm=None):
    mm = mm or dataclasses.replace(load_machine("p100", nodes=1), devices_per_node=2)
    return Simulator.for_model(model, mm, CostModel(mm, measured=False))


def test_search_is_reproducible_and_no_worse_than_every_baseline():
    model = mlp()
    a = search(simulator(model), budget=24, seed=3, model=model)
    b = search(simulator(model), budget=24, seed=3, model=model)
    assert a.best == b.best and a.best_time == b.best_time and a.history == b.history
    assert 0 < a.proposals <= 24
    assert a.best_time <= min(a.baselines.values())
    assert set(a.baselines) == {"data", "model", "expert", "tensor"}
    # the predicted time of the result is what the simulator says of it
    assert simulator(model).simulate(a.best).time == pytest.approx(a.best_time)


def test_the_loss_keeps_the_config_a_run_gives_it():
    """A strategy file names the model's ops and a run gives the loss its default config, so the
    search leaves the loss there: the predicted time is that of the strategy as it will run."""
    from ops.lower import default_config
    model = mlp()
    sim = simulator(model)
    loss = next(op for op in sim.ops if op.name == sim.loss)
    result = search(sim, budget=60, seed=5, model=model)
    assert result.accepted > 0 and result.best.ops[sim.loss] == default_config(loss, sim.machine)
    as_run = {name: config for name, config in result.best.ops.items() if name != sim.loss}
    assert simulator(model).simulate(as_run).time == result.best_time


def test_strategies_that_do_not_fit_are_rejected():
    model = mlp()
    mm = dataclasses.replace(load_machine("p100", nodes=1), devices_per_node=2)
    tight = dataclasses.replace(mm, device=dataclasses.replace(mm.device, mem_bytes=60_000))
    result = search(simulator(model, tight), budget=30, seed=1, model=model)
    assert result.infeasible > 0
    assert math.isfinite(result.best_time) and simulator(model, tight).simulate(result.best).fits


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="budget must be a positive int"):
        search(simulator(mlp()), budget=0)
    with pytest.raises(ValueError, match="starts must be some of"):
        search(simulator(mlp()), budget=5, starts=("nonsense",))
    one = search(simulator(mlp()), budget=3, starts="random")   # one name, not its letters
    assert one.proposals == 3


def test_bad_seeds_and_seconds_are_refused():
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        search(simulator(mlp()), budget=5, seed=-1)
    with pytest.raises(ValueError, match="seconds must be more than 0"):
        search(simulator(mlp()), budget=5, seconds=0)


@pytest.mark.parametrize("beta", [-1.0, 0.0, float("nan"), float("inf"), "hot", True])
def test_bad_betas_are_refused(beta):
    """A negative or NaN beta used to run: a chain that takes every proposal, or none."""
    with pytest.raises(ValueError, match="beta must be a positive finite number"):
        search(simulator(mlp()), budget=5, beta=beta)


def test_a_numpy_int_beta_is_a_number():
    assert search(simulator(mlp()), budget=3, beta=np.int64(500)).proposals == 3


def test_an_unknown_app_is_named():
    from strategies.search import app_graph
    with pytest.raises(ValueError, match="no app named 'nosuch'; the apps are mlp, alexnet"):
        app_graph("nosuch")


@pytest.mark.parametrize("flags, said", [(["--budget", "0"], "--budget 0: must be at least 1"),
                                         (["--nodes", "0"], "--nodes 0: must be at least 1"),
                                         (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
                                         (["--seconds", "-1"], "--seconds -1.0: must be more than 0"),
                                         (["--seed", "-3"], "--seed -3: must be at least 0"),
                                         (["-o", "/no/such/folder/s.json"],
                                          "-o /no/such/folder/s.json: the folder /no/such/folder does not exist")])
def test_the_command_line_names_an_out_of_range_number(flags, said, capsys):
    """One line naming the flag and its value, exit status 2, before any graph is built."""
    import strategies.search as search_module
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", "p100", *flags]) == 2
    assert capsys.readouterr().err == f"error: {said}\n"


@pytest.mark.parametrize("module, argv, said", [
    ("strategies.search", ["--app", "mlp", "--batch-size", "2.5"], "argument --batch-size: invalid int value: '2.5'"),
    ("apps.demo", ["--ranks", "x"], "argument --ranks: 'x' is not an integer"),
    ("tools.trace", ["summary", "t.jsonl", "--top", "0"], "argument --top: '0' is not a whole number >= 1"),
    ("tools.strategy", ["draw"], "the following arguments are required: file, --app, -o/--output"),
    ("strategies.cost", [], "the following arguments are required: command")])
def test_every_command_s_bad_flag_is_one_line(module, argv, said, capsys):
    """argparse printed its usage block and `prog: error:` above the message."""
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {said}\n"


def test_the_command_line_refuses_to_run_under_mpiexec(capsys, monkeypatch):
    """Under mpiexec every rank searched alone and wrote the same -o file."""
    import strategies.search as search_module
    monkeypatch.setenv("PMI_SIZE", "2")
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", "p100"]) == 2
    assert "runs in one process, not under mpiexec" in capsys.readouterr().err


def test_the_command_line_help_gives_the_defaults_it_has(capsys):
    """--help used to print "(default: the app's) (default: None)" beside flags with no fixed default."""
    import strategies.search as search_module
    with pytest.raises(SystemExit):
        search_module.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: 1000)" in text and "(default: the app's)" in text


def test_the_command_line_says_when_no_strategy_fits_and_writes_none(tmp_path, capsys):
    import strategies.search as search_module
    from strategies.machine_model import machine_path
    data = json.loads(machine_path("p100").read_text())
    data["device"]["mem_bytes"] = 1000
    small = tmp_path / "small.json"
    small.write_text(json.dumps(data))
    out = tmp_path / "s.json"
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", str(small), "--nodes", "1", "--budget", "3",
                               "-o", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()[-1]   # after the progress lines
    assert err.startswith("error: no strategy fits the memory of p100's gpu devices (9.31e-07 GiB each)")
    assert not out.exists()
    # figures so extreme that every time overflows: said so, not blamed on the memory
    data["device"]["mem_bytes"], data["intra_node"]["bandwidth"] = 16e9, 5e-324
    small.write_text(json.dumps(data))
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", str(small), "--nodes", "1", "--budget", "3",
                               "-o", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: every strategy's predicted time is infinite on {small}: its figures (bandwidths, latencies, "
        f"overheads) make a time overflow")
    assert not out.exists()
    # the hosts' memory is what is short: named, not the GPUs'
    data["intra_node"]["bandwidth"], data["host"]["mem_bytes"] = 1e10, 1e4
    small.write_text(json.dumps(data))
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", str(small), "--nodes", "1", "--budget", "3",
                               "-o", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "error: no strategy fits the memory of p100's hosts (9.31e-06 GiB each): not the baselines")
    assert search_module.main(["--app", "mlp", "--tiny", "--machine", "p100", "--batch-size", str(10 ** 23)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --batch-size {10 ** 23}: ")


def test_an_app_is_simulated_at_its_own_batch_with_its_own_optimizer(capsys):
    """What the apps train with by default (App: Inception-v3 tiny at batch 8, the recurrent apps
    and the transformer with Adam): a strategy searched for an app is timed as the app runs."""
    from apps import inception_v3
    from ops.optimizers import SGD, Adam
    from strategies.search import app_graph, app_optimizer, app_simulator
    model, _ = app_graph("inception_v3", tiny=True)
    assert model.inputs[0].shape[0] == inception_v3.APP.tiny_batch_size == 8
    assert app_graph("inception_v3", 4, tiny=True)[0].inputs[0].shape[0] == 4
    assert app_optimizer("mlp") == SGD(lr=0.01, momentum=0.9)
    assert app_optimizer("nmt") == Adam(lr=0.001) and app_optimizer("nmt", tiny=True) == Adam(lr=0.01)
    assert app_optimizer("nmt", kind="sgd") == SGD(lr=0.001, momentum=0.9)
    model, sim = app_simulator("transformer", load_machine("p100", nodes=1), tiny=True)
    assert sim.optimizer == Adam(lr=1e-4) and model.inputs[0].shape[0] == 8 and sim.ops[0].name == model.ops[0].name
    _, sgd = app_simulator("transformer", load_machine("p100", nodes=1), 4, True, optimizer="sgd")
    assert sgd.optimizer.kind == "sgd"
    import strategies.search as search_module
    for flags, kind in (((), "adam"), (("--optimizer", "sgd"), "sgd")):
        assert search_module.main(["--app", "rnntc", "--tiny", "--machine", "p100", "--nodes", "1", "--budget", "2",
                                   *flags]) == 0
        report = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert report["optimizer"] == kind and report["batch_size"] == 16


def test_the_command_line_searches_in_the_app_s_dtype(capsys):
    """--dtype as the apps take it: the mlp's graph in float64 (twice the bytes of float32), and a
    clear refusal where an app computes in float32 whatever it is given (token ids in)."""
    import strategies.search as search_module
    for dtype in ("float32", "float64"):
        assert search_module.main(["--app", "mlp", "--tiny", "--machine", "p100", "--nodes", "1", "--budget", "2",
                                   "--dtype", dtype]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["dtype"] == dtype
    assert search_module.main(["--app", "rnntc", "--tiny", "--machine", "p100", "--budget", "2", "--dtype",
                               "float64"]) == 2
    assert capsys.readouterr().err == ("error: --dtype float64: rnntc computes in float32 (its inputs are not "
                                       "floats)\n")


def test_the_command_line_writes_a_strategy_the_app_trains_with(tmp_path):
    out = tmp_path / "mlp.json"
    proc = subprocess.run([sys.executable, "-m", "strategies.search", "--app", "mlp", "--tiny", "--machine", "local",
                           "--nodes", "1", "--budget", "6", "-o", str(out)], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["app"] == "mlp" and report["proposals"] <= 6 and "searched" in proc.stdout
    assert json.loads(out.read_text())["model"] == "mlp"
    run = subprocess.run([sys.executable, "-m", "apps.mlp", "--tiny", "--iterations", "2", "--strategy", str(out)],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["strategy"] == str(out)
    bad = subprocess.run([sys.executable, "-m", "strategies.search", "--app", "mlp", "--machine", "nowhere"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --machine nowhere:")


def test_a_neighbour_proposal_takes_the_config_of_an_op_next_to_it_where_it_fits(monkeypatch):
    import numpy as np

    import strategies.search as search_module
    from ops.lower import TileConfig
    from ops.strategy import Strategy

    model = mlp()
    sim = simulator(model)
    ops = {op.name: op for op in sim.ops}
    neighbours = search_module._neighbours(sim.ops)
    first, second = [op.name for op in sim.ops if op.kind == "dense"]
    assert first in neighbours[second] and second in neighbours[first]
    assert all(name not in neighbours[name] for name in neighbours)
    monkeypatch.setattr(search_module, "NEIGHBOUR_SHARE", 1.0)
    split = TileConfig((1, 2, 1), (0, 1))                    # the first dense's outputs split in two
    current = Strategy(sim.fingerprint, {**sim.configs(None), first: split})
    assert search_module._propose(sim, ops[second], current, [first], np.random.default_rng(0)) == split
    # a config of another tile space (4 dims for a dense's 3) does not fit: a drawn one instead
    current = Strategy(sim.fingerprint, {**sim.configs(None), first: TileConfig((2, 1, 1, 1), (0, 1))})
    drawn = search_module._propose(sim, ops[second], current, [first], np.random.default_rng(0))
    assert len(drawn.degrees) == 3
    # the neighbour's config is the op's own: a proposal that changes nothing is not made, a drawn one instead
    current = Strategy(sim.fingerprint, {**sim.configs(None), first: split, second: split})
    drawn = TileConfig((2, 1, 1), (1, 0))
    monkeypatch.setattr(search_module, "proposal_config", lambda op, machine, rng: drawn)
    assert search_module._propose(sim, ops[second], current, [first], np.random.default_rng(0)) is drawn


def test_the_random_start_is_drawn_from_the_proposals():
    import numpy as np

    from strategies.random import random_strategy, tile_counts

    model = mlp()
    sim = simulator(model)
    s = random_strategy(model, sim.machine, np.random.default_rng(5), shaped=True)
    assert s == random_strategy(model, sim.machine, np.random.default_rng(5), shaped=True)
    configs, _ = s.resolve([op for op in sim.ops if op.name != sim.loss], sim.machine, fingerprint=sim.fingerprint)
    counts = tile_counts(sim.machine)
    # proposal configs have a tile count that fits the machine's layout, on consecutive devices
    # (or, one in UNSHAPED_SHARE, are any config: seed 5 draws none of those here)
    for c in configs.values():
        assert c.num_tiles in counts
        assert list(c.devices) == list(range(c.devices[0], c.devices[0] + c.num_tiles))


def test_a_proposal_that_repeats_a_strategy_is_not_simulated_again(monkeypatch):
    """The chains meet strategies timed before (a baseline, a neighbour's config the op already
    has, a move back); the memo answers those. On a three-op graph most proposals repeat one."""
    model = mlp()
    sim = simulator(model)
    timed = []
    simulate = sim.simulate

    def counting(strategy, *args, **kwargs):
        timed.append(tuple(sorted(strategy.ops.items())))
        return simulate(strategy, *args, **kwargs)
    monkeypatch.setattr(sim, "simulate", counting)
    result = search(sim, budget=60, seed=1, model=model)
    assert len(timed) == len(set(timed)), "a strategy simulated twice"
    assert len(timed) < result.proposals


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_proposal_key_made_by_one_change_equals_one_made_afresh(seed):
    """The memo's key of a proposal is its chain's with one op's config replaced (its hash by one
    term): equal to the key made from the whole strategy, hash and all."""
    from strategies.random import random_strategy
    from strategies.search import _Memo
    model = mlp()
    sim = simulator(model)
    memo = _Memo(sim)
    rng = np.random.default_rng(seed)
    current = random_strategy(sim.ops, sim.machine, rng)
    key = memo.key(current)
    for _ in range(6):
        op = sim.ops[int(rng.integers(len(sim.ops)))]
        config = random_strategy([op], sim.machine, rng).ops[op.name]
        proposal = current.replace(op.name, config)
        replaced = key.replaced(memo.place[op.name], config)
        fresh = memo.key(proposal)
        assert replaced == fresh and hash(replaced) == hash(fresh)
        if rng.random() < 0.5:
            current, key = proposal, replaced


def test_the_chains_take_a_tenth_in_turn_then_the_lowest_goes_on_alone(monkeypatch):
    """Each start's chain walks its share of BURN_IN of the budget; then the chain that stands
    lowest walks the rest, from where it stood."""
    import strategies.search as searching
    walks = []
    walk = searching._walk

    def recording(sim, chain, n, *args):
        done = args[2].proposals
        walks.append((chain.start, n, chain.current_time, chain.current))
        walk(sim, chain, n, *args)
        walks[-1] += (args[2].proposals - done, chain.current_time, chain.current)
    monkeypatch.setattr(searching, "_walk", recording)
    model = mlp()
    result = search(simulator(model), budget=90, seed=2, model=model)
    burn = walks[:3]
    assert [w[0] for w in burn] == ["data", "expert", "random"]
    assert [w[1] for w in burn] == [3, 3, 3]   # round(90 * 0.1) = 9 in turn
    start, n, time_then, where_then = walks[3][:4]
    leader = min(burn, key=lambda w: w[5])
    assert start == leader[0] and time_then == leader[5] and where_then is leader[6]
    assert n == 90 - sum(w[4] for w in burn)
    assert result.proposals == sum(w[4] for w in walks)


def test_the_api_names_a_wrong_kind_of_argument():
    """Each of these used to fail deep inside (an AttributeError on a str, a Model or an int)."""
    import numpy as np
    m = Model(Runtime(execute=False), weights=False)
    m.softmax(m.dense(m.input((8, 6)), 3))
    mm = load_machine("p100")
    for call, match in ((lambda: CostModel("p100"), r"CostModel: machine_model must be a MachineModel"),
                        (lambda: Simulator.for_model(m, "p100"), r"Simulator: machine_model must be a MachineModel"),
                        (lambda: Simulator.for_model(m, mm, cost="analytic"), r"Simulator: cost must be a CostModel"),
                        (lambda: search(m, 2), r"search: sim must be a Simulator"),
                        (lambda: Simulator.for_model("mlp", mm), r"Simulator.for_model: model must be an ops.Model"),
                        (lambda: Simulator.for_model(None, mm), r"Simulator.for_model: model must be an ops.Model"),
                        (lambda: search(Simulator.for_model(m, mm), 2, model="x"),
                         r"search: model must be the simulator's ops.Model")):
        with pytest.raises(TypeError, match=match):
            call()
    with pytest.raises(ValueError, match=r"Simulator: the model has no operators"):
        Simulator.for_model(Model(Runtime(execute=False), weights=False), mm)
    sim = Simulator.for_model(m, mm)
    with pytest.raises(TypeError, match=r"search: progress must be a stream with write"):
        search(sim, 2, progress=5)
    for seconds in ("1", True):
        with pytest.raises(ValueError, match=r"search: seconds must be more than 0"):
            search(sim, 2, seconds=seconds)
    assert search(sim, np.int64(3)).proposals >= 1   # numpy ints, as TileConfig takes them
    assert Simulator.for_model(m, mm, optimizer="adam").optimizer.kind == "adam"
    with pytest.raises(TypeError, match=r"Simulator: optimizer must be 'sgd', 'adam' or an optimizer object"):
        Simulator.for_model(m, mm, optimizer=5)
    assert load_machine("p100", nodes=np.int64(2)).nodes == 2


def test_the_chains_make_no_reference_cycles():
    """The search pauses the cycle collector while its chains run (_collector_paused): that frees
    nothing late only while a proposal leaves no cycle behind, and restores the collector after."""
    model = mlp()
    sim = simulator(model)
    search(sim, budget=4, seed=0, model=model)   # the caches' first fill, and their cycles if any
    assert gc.isenabled() and gc.get_freeze_count() == 0   # the collector as it was
    gc.collect()
    gc.disable()
    try:
        search(sim, budget=40, seed=1, model=model)
        assert gc.collect() == 0
    finally:
        gc.enable()


def _walk_against(sim, worse_by: float, beta: float, n: int):
    """A chain from data parallelism walked `n` proposals by strategies.search._walk, every
    proposal timed `worse_by` seconds slower than where the chain stands (the memo's time
    replaced) and fitting: the chain's best never improves."""
    import strategies.search as searching
    from strategies import data_parallel
    memo = searching._Memo(sim)
    ops = [op for op in sim.ops if op.name != sim.loss]
    start = searching._complete(sim, data_parallel(ops, sim.machine))
    chain = searching._Chain("data", start, memo.key(start), 1.0, 1.0)
    memo.time = lambda key, strategy: chain.current_time + worse_by
    memo.fits = lambda key, strategy: True
    result = searching.SearchResult(start, 1.0, {})
    searching._walk(sim, chain, n, ops, searching._neighbours(sim.ops), result, np.random.default_rng(0),
                    beta, None, searching._Bar(None, n), memo)
    return result


def test_a_proposal_slower_than_the_chain_is_accepted_with_probability_exp_minus_beta_times_the_loss():
    """Metropolis-Hastings takes a slower proposal with probability exp(beta * (current - t)):
    10 ms slower at beta 1e4 is exp(-100), never; at beta 1e-6 it is all but certain. With the
    sign turned round, the chain took every slower proposal, however large beta."""
    sim = simulator(mlp())
    assert _walk_against(sim, 0.01, 1e4, 20).accepted == 0
    easy = _walk_against(sim, 0.01, 1e-6, 20)
    assert easy.accepted == easy.proposals > 0


def test_a_chain_whose_best_never_improves_stops_after_half_its_proposals():
    """A chain stops once its best has not improved for n / 2 proposals: of 20 proposals none
    better, it makes 20 // 2 + 1 = 11 (the 11th is the one past half), not all 20."""
    sim = simulator(mlp())
    assert _walk_against(sim, 0.01, 1e4, 20).proposals == 11
    assert _walk_against(sim, 0.01, 1e4, 7).proposals == 4


def test_whether_a_strategy_fits_is_its_own_not_the_last_simulated_ones():
    """The memo answers fits from the last simulation's result only where that was the same
    strategy's. On a device of 60,000 bytes model parallelism fits (59 KB) and data parallelism
    does not (69 KB): timing the first, then the second, then asking whether the first fits
    must say it does (it used to be given the second's answer, and an infinite time)."""
    import strategies.search as searching
    from strategies import data_parallel, model_parallel
    model = mlp()
    mm = dataclasses.replace(load_machine("p100", nodes=1), devices_per_node=2)
    sim = simulator(model, dataclasses.replace(mm, device=dataclasses.replace(mm.device, mem_bytes=60_000)))
    memo = searching._Memo(sim)
    fitting = searching._complete(sim, model_parallel(model, sim.machine))
    too_big = searching._complete(sim, data_parallel(model, sim.machine))
    t = memo.time(memo.key(fitting), fitting)
    memo.time(memo.key(too_big), too_big)
    assert memo.feasible_time(fitting) == t and math.isfinite(t)
    assert memo.feasible_time(too_big) == math.inf
