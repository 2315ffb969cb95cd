"""The public API refuses bad input before any work, naming the argument and the value.

One test per class of bad input: float sizes, non-numeric arrays, empty inputs, damaged
checkpoints, non-finite losses, and a failed task that was the input's fault (after which
the runtime goes on).
"""
from __future__ import annotations

import itertools
import json
import threading
import warnings
from contextlib import suppress

import numpy as np
import pytest

from ops.model import Model
from taskrt import Machine, Runtime, TaskError, WRITE, req


def _mlp(rt, batch=4, features=3):
    m = Model(rt, seed=0)
    x = m.input((batch, features), name="x")
    m.dense(x, 2)
    m.compile()
    return m


@pytest.mark.parametrize("make,match", [
    (lambda rt: rt.region((4.5,)), r"shape must be ints, got float 4.5"),
    (lambda rt: rt.region((True, 2)), r"shape must be ints, got bool True"),
    (lambda rt: rt.region((4,)).partition((2.5,)), r"partition degrees .* must be ints, got float 2.5"),
    (lambda rt: rt.region((-1,)), r"shape must be >= 0, got -1"),
])
def test_float_and_negative_sizes_are_refused_not_truncated(make, match):
    with Runtime(cpus=1) as rt:
        with pytest.raises((TypeError, ValueError), match=match):
            make(rt)


@pytest.mark.parametrize("kwargs,match", [({"cpus": 1.5}, r"cpus must be an int, got float 1.5"),
                                          ({"cpus": 0}, r"cpus must be >= 1, got 0"),
                                          ({"gpus": 0.5}, r"gpus must be an int, got float 0.5")])
def test_runtime_sizes_are_checked(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Runtime(**kwargs)


def test_machine_sizes_are_checked():
    with pytest.raises(TypeError, match=r"cpus_per_rank must be an int, got float 2.0"):
        Machine.build(1, 2.0)
    with pytest.raises(ValueError, match=r"num_ranks must be >= 1, got 0"):
        Machine.build(0, 1)


@pytest.mark.parametrize("kwargs,match", [({"iterations": 2.5}, r"iterations must be an int, got float 2.5"),
                                          ({"epochs": 1.5}, r"epochs must be an int, got float 1.5"),
                                          ({"iterations": 0}, r"iterations must be >= 1, got 0"),
                                          ({"batch_size": "4"}, r"batch_size must be an int, got str")])
def test_fit_counts_must_be_ints(kwargs, match):
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        with pytest.raises((TypeError, ValueError), match=match):
            m.fit({"x": np.ones((4, 3))}, np.zeros(4, "int64"), verbose=False, **kwargs)
        assert m.step == 0


def test_string_arrays_are_refused_naming_the_input_or_parameter():
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        x = np.ones((4, 3))
        with pytest.raises(ValueError, match=r"fit: input 'x' must hold numbers, got dtype <U"):
            m.fit({"x": x.astype(str)}, np.zeros(4, "int64"), iterations=1, verbose=False)
        with pytest.raises(ValueError, match=r"fit: labels must hold numbers, got dtype <U"):
            m.fit({"x": x}, np.zeros(4).astype(str), iterations=1, verbose=False)
        with pytest.raises(ValueError, match=r"set_parameters: dense_0.weight must hold numbers, got dtype object"):
            m.set_parameters({"dense_0.weight": np.array([[None] * 3] * 2)})
        with pytest.raises(ValueError, match=r"predict: input 'x' must hold numbers"):
            m.predict({"x": [["a", "b", "c"]] * 4})
        assert m.step == 0


@pytest.mark.parametrize("call", ["predict", "evaluate", "fit"])
def test_zero_samples_are_refused(call):
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        x, y = np.ones((0, 3)), np.zeros(0, "int64")
        args = (x,) if call == "predict" else (x, y)
        with pytest.raises(ValueError, match=rf"{call}: no samples"):
            getattr(m, call)(*args)


def _saved(tmp_path):
    path = tmp_path / "m.npz"
    with Runtime(cpus=1) as rt:
        _mlp(rt).save(path)
    return path


@pytest.mark.parametrize("damage,match", [
    ("empty", r"not a model file .*: the file is empty"),
    ("text", r"not a model file .*: its bytes are not a complete .npz"),
    ("truncated", r"not a model file .*: its bytes are not a complete .npz"),
    ("other npz", r"an .npz but not a model file: it has no 'meta' entry \(it holds \['a'\]\)"),
    ("one array", r"not a model file: it holds one array"),
    ("missing", r"can't read the file"),
])
def test_damaged_checkpoints_name_the_path(tmp_path, damage, match):
    path = _saved(tmp_path)
    bad = tmp_path / "bad.npz"
    if damage == "empty":
        bad.write_bytes(b"")
    elif damage == "text":
        bad.write_text("hello")
    elif damage == "truncated":
        data = path.read_bytes()
        bad.write_bytes(data[:len(data) // 2])
    elif damage == "other npz":
        np.savez(bad, a=np.ones(3))
    elif damage == "one array":
        with open(bad, "wb") as f:
            np.save(f, np.ones(3))
    with pytest.raises(ValueError, match=match) as info:
        Model.load(str(bad))
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("damage,match", [
    ("no weight", r"a damaged model file: no 'dense_0.bias'"),
    ("state shape", r"optimizer state 'opt/dense_0.weight/exp_avg' is float32\[2, 3\], this model's float32\[5, 3\]"),
    ("step", r"a damaged model file: its step is 'four', not a count"),
    ("step true", r"a damaged model file: its step is True, not a count"),   # (True passed for 1)
    ("data order", r"a damaged model file: its data-order generator state does not load"),
    ("no data order", r"a damaged model file: no 'data_rng'"),
])
def test_a_damaged_checkpoint_changes_nothing_in_the_model_it_is_loaded_into(tmp_path, damage, match):
    """Missing weights were not noticed (the model's own stayed, the step and optimizer state came
    from the file), and the optimizer state, step and data order were checked after the weights
    were replaced, in errors that did not name the file."""
    path, bad = tmp_path / "m.npz", tmp_path / "bad.npz"
    with Runtime(cpus=1) as rt:
        m = Model(rt, seed=0)
        m.dense(m.dense(m.input((4, 3), name="x"), 5), 2)
        m.compile("adam")
        m.fit({"x": np.ones((4, 3))}, np.zeros(4, "int64"), iterations=2, verbose=False)
        m.save(path)
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        meta = json.loads(str(arrays.pop("meta")))
        if damage == "no weight":
            del arrays["param/dense_0.bias"]
        elif damage == "state shape":
            arrays["opt/dense_0.weight/exp_avg"] = arrays["opt/dense_0.weight/exp_avg"][:2]
        elif damage == "step":
            meta["step"] = "four"
        elif damage == "step true":
            meta["step"] = True
        elif damage == "data order":
            meta["data_rng"] = {"bit_generator": "PCG64", "state": "garbage"}
        else:
            del meta["data_rng"]
        np.savez(bad, meta=np.array(json.dumps(meta)), **arrays)
        m.fit({"x": np.full((4, 3), 2.0)}, np.ones(4, "int64"), iterations=1, verbose=False)
        before = m.parameters(), m.step
        with pytest.raises(ValueError, match=match) as info:
            m.load(bad)
        assert str(info.value).startswith(f"load {bad}: ")
        assert m.step == before[1] == 3
        for name, value in before[0].items():
            np.testing.assert_array_equal(m.parameters()[name], value, err_msg=name)
        with pytest.raises(ValueError, match=match):
            Model.load(bad, runtime=rt)


def test_saving_into_a_missing_folder_or_onto_one_is_refused_before_any_work(tmp_path):
    """Under mpiexec rank 0's failed write ended every rank; the path is checked on each first."""
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        issued = rt.issued
        with pytest.raises(FileNotFoundError, match=f"save {tmp_path}/nowhere/m.npz: no folder "
                                                    f"'{tmp_path}/nowhere' to write it in"):
            m.save(tmp_path / "nowhere" / "m.npz")
        with pytest.raises(TypeError, match=r"save: a file's path \(str or path-like\), got int 5"):
            m.save(5)
        with pytest.raises(IsADirectoryError, match=f"save {tmp_path}: a folder, not a file to write"):
            m.save(tmp_path)   # (it wrote the whole file beside it, then failed to rename it)
        assert rt.issued == issued


def test_a_non_finite_loss_is_reported_and_can_stop_training():
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        m.set_parameters({"dense_0.weight": np.full((2, 3), 1e30)})
        x = np.full((4, 3), 1e30)   # finite data whose logits overflow float32
        with pytest.warns(RuntimeWarning, match=r"fit: the loss of iteration 1 is nan"):
            history = m.fit({"x": x}, np.zeros(4, "int64"), iterations=5, verbose=False, stop_on_nan=True)
        assert len(history.loss) == 1 and np.isnan(history.loss[0])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            history = m.fit({"x": x}, np.zeros(4, "int64"), iterations=3, verbose=False)
        assert len(history.loss) == 3 and len([w for w in seen if "is nan" in str(w.message)]) == 3


def test_a_task_that_fails_on_bad_data_leaves_the_runtime_usable():
    with Runtime(cpus=2) as rt:
        r = rt.region((4,), name="r")

        def check(view, value):
            if value < 0:
                raise ValueError(f"value {value} is negative")
            view[...] = value

        rt.launch(check, req(r, WRITE), args=(-1.0,))
        with pytest.raises(TaskError, match="value -1.0 is negative"):
            rt.wait()
        rt.recover()
        rt.launch(check, req(r, WRITE), args=(2.0,))
        np.testing.assert_array_equal(rt.read(r), np.full(4, 2.0, "float32"))
        m = _mlp(rt)
        m.fit({"x": np.ones((4, 3))}, np.zeros(4, "int64"), iterations=1, verbose=False)


def test_train_on_recovers_the_runtime_after_a_bad_batch_and_wants_a_function():
    """A source giving the wrong width failed its step, and the runtime stayed stopped: the next
    fit raised that step's error again."""
    with Runtime(cpus=2) as rt:
        m = _mlp(rt, batch=4, features=3)
        with pytest.raises(TypeError, match="train_on: source must be a function source\\(step, lo, hi\\)"):
            m.train_on("data", 1)
        with pytest.raises(TaskError, match="has shape \\(.*, 2\\), expected"):
            list(m.train_on(lambda step, lo, hi: (np.ones((hi - lo, 2), "float32"), np.zeros(hi - lo, "int64")), 2))
        losses = list(m.train_on(lambda step, lo, hi: (np.ones((hi - lo, 3), "float32"), np.zeros(hi - lo, "int64")), 2))
        assert len(losses) == 2 and all(np.isfinite(losses))
        m.fit({"x": np.ones((4, 3))}, np.zeros(4, "int64"), iterations=1, verbose=False)


def test_a_failed_step_keeps_the_steps_before_it_and_the_count_of_those_that_ran():
    """A source failing at step 3 left step 2's update applied, half applied or not at all, at
    random (queued behind the failure, it was skipped), and the step count at 3 or 4: Adam's next
    update then took the wrong bias correction. Now steps 1 and 2 land, the count says 2, and
    training on gives what an unbroken run gives."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((24, 3)).astype("float32"), rng.integers(0, 2, 24)

    def good(step, lo, hi):
        at = 4 * (step - 1) % 20
        return x[at + lo:at + hi], y[at + lo:at + hi]

    def bad(step, lo, hi):
        if step == 3:
            raise KeyError("boom")
        return good(step, lo, hi)

    def mlp(rt):
        m = Model(rt, seed=0)
        m.dense(m.dense(m.input((4, 3), name="x"), 5, activation="relu"), 2)
        m.compile("adam")
        return m

    with Runtime(cpus=2) as rt:
        ref = mlp(rt)
        ref_losses = list(ref.train_on(good, 4))
        for _ in range(4):
            m = mlp(rt)
            with pytest.raises(TaskError, match="KeyError"):
                list(m.train_on(bad, 4))
            assert m.step == 2
            losses = list(m.train_on(good, 2))
            assert losses == pytest.approx(ref_losses[2:], rel=1e-6)
            for name, value in ref.parameters().items():
                np.testing.assert_allclose(m.parameters()[name], value, rtol=1e-6, atol=1e-7)


def test_a_step_failing_midway_leaves_no_saved_tensors_for_the_backwards_that_come_after(monkeypatch):
    """The failed step's layer norm ran its forward, which keeps its rows' means and deviations for
    its backward; the backward was skipped, they stayed queued, and from then on every backward of
    the layer norm took the step before's: the step redone matched (the same batch and weights),
    the next did not."""
    from ops.linear import Dense
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 3)).astype("float32"), rng.integers(0, 2, 16)
    calls, forward = itertools.count(1), Dense.forward

    def source(step, lo, hi):
        at = 4 * (step - 1) % 16
        return x[at + lo:at + hi], y[at + lo:at + hi]

    def second_fails_at_step_3(self, *args, **kwargs):
        if self.name == "out" and next(calls) == 5:   # two tiles a step
            raise ArithmeticError("out of order")
        return forward(self, *args, **kwargs)

    def mlp(rt):
        m = Model(rt, seed=0)
        m.dense(m.layer_norm(m.dense(m.input((4, 3), name="x"), 5)), 2, name="out")
        m.compile("sgd")
        return m

    with Runtime(cpus=2) as rt:
        ref = mlp(rt)
        ref_losses = list(ref.train_on(source, 5))
        m = mlp(rt)
        monkeypatch.setattr(Dense, "forward", second_fails_at_step_3)
        with pytest.raises(TaskError, match="out of order"):
            list(m.train_on(source, 5))
        assert m.step == 2
        assert list(m.train_on(source, 3)) == pytest.approx(ref_losses[2:], rel=1e-6)
        for name, value in ref.parameters().items():
            np.testing.assert_allclose(m.parameters()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_step_stopped_halfway_through_its_launches_is_taken_back(monkeypatch):
    """The first step's program is recorded launch by launch: a failure meanwhile stopped the
    runtime, the next launch raised, the step was never filed among those issued, and the count
    stayed 1 (about a third of the runs whose batch source failed at step 1: training on skipped
    a batch, and Adam's bias correction was a step off)."""
    with Runtime(cpus=2) as rt:
        m = Model(rt, seed=0)
        m.dense(m.input((8, 6), name="x"), 3)
        m.compile("adam")

        def stopped_halfway(step, **kwargs):
            rt.launch(lambda: 1 // 0, name="div")
            with suppress(TaskError):
                rt.wait()
            rt.launch(lambda: None, name="after")   # refused: the runtime stopped
        monkeypatch.setattr(m._low, "train_step", stopped_halfway)
        with pytest.raises(TaskError, match="ZeroDivisionError"):
            list(m.train_on(lambda step, lo, hi: (np.ones((hi - lo, 6)), np.zeros(hi - lo, "int64")), 3))
        assert m.step == 0


def test_a_failure_that_surfaces_in_parameters_leaves_the_runtime_usable(monkeypatch):
    """train_on returns once the last loss is in; a backward failing after that raised in
    parameters(), which did not recover: every later read or save said the runtime had stopped."""
    from ops.linear import Dense
    gate, backward, calls = threading.Event(), Dense.backward, itertools.count(1)
    x, y = np.ones((8, 6)), np.zeros(8, "int64")

    def third_step_fails_late(self, *args, **kwargs):
        if self.name == "out" and next(calls) == 5:   # two tiles a step
            gate.wait(10)
            raise ArithmeticError("late")
        return backward(self, *args, **kwargs)
    with Runtime(cpus=2) as rt:
        m = Model(rt, seed=0)
        m.dense(m.dense(m.input((8, 6), "float64", name="x"), 8, activation="relu"), 3, name="out")
        m.compile("sgd")
        monkeypatch.setattr(Dense, "backward", third_step_fails_late)
        assert len(list(m.train_on(lambda step, lo, hi: (x[lo:hi], y[lo:hi]), 3))) == 3
        gate.set()
        with pytest.raises(TaskError, match="late"):
            m.parameters()
        assert m.step == 2 and m.parameters() and m.stats() == {}


def test_a_tuple_of_tensors_where_one_goes_is_named_as_such():
    """lstm's (y, h_n, c_n) passed on whole used to be called "not a tensor of this model"."""
    m = Model(weights=False)
    out = m.lstm(m.embedding(m.input((4, 5), "int64"), 10, 6), 7)
    with pytest.raises(TypeError, match=r"dense input 0: got a tuple of 3 tensors \(lstm_0.out0, lstm_0.out1, "
                                        r"lstm_0.out2\), where one tensor goes: pass one of them"):
        m.dense(out, 10)
    assert m.dense(out[0], 10).shape == (4, 5, 10)


def test_an_embedding_index_out_of_range_is_refused_before_any_work():
    with Runtime(cpus=2) as rt:
        m = Model(rt, seed=0)
        ids = m.input((4, 3), dtype="int64", name="ids")
        m.dense(m.flat(m.embedding(ids, 10, 4)), 2)
        m.compile()
        bad = np.full((4, 3), 2)
        bad[1, 2] = 12
        launched = rt._launch_count
        with pytest.raises(ValueError, match=r"fit: input 'ids' \(embedding 'embedding_0'\): index 12 at \(1, 2\) "
                                             r"is out of range \[0, 10\)"):
            m.fit({"ids": bad}, np.zeros(4, "int64"), iterations=1, verbose=False)
        with pytest.raises(ValueError, match=r"predict: input 'ids' .* index -1"):
            m.predict({"ids": np.full((4, 3), -1)})
        assert rt._launch_count == launched and m.step == 0
        history = m.fit({"ids": np.full((4, 3), 2)}, np.zeros(4, "int64"), iterations=1, verbose=False)
        assert np.isfinite(history.loss[0])


@pytest.mark.parametrize("build,match", [
    (lambda m, x: m.input((4.0, 3)), r"input shape must be ints, got float 4.0"),
    (lambda m, x: m.conv2d(x, 2.5, 3), r"conv2d 'conv2d_0': out_channels must be an int, got float 2.5"),
    (lambda m, x: m.pool2d(x, 2.5), r"pool2d 'pool2d_0': kernel must be an int, got float 2.5"),
    (lambda m, x: m.batch_norm(x, eps="a"), r"batch_norm 'batch_norm_0': eps must be a finite number, got str"),
    (lambda m, x: m.batch_norm(x, momentum=2), r"momentum must be in \[0, 1\], got 2"),
    (lambda m, x: m.layer_norm(x, eps=-1), r"layer_norm 'layer_norm_0': eps must be in \(0, inf\], got -1"),
    (lambda m, x: m.dropout(x, rate=float("nan")), r"dropout 'dropout_0': rate must be a finite number"),
    # yes/no attributes were bool() of anything: the string "False" was true
    (lambda m, x: m.conv2d(x, 2, 3, use_bias="False"), r"conv2d 'conv2d_0': use_bias must be True or False, got "
                                                       r"str 'False'"),
    (lambda m, x: m.batch_norm(x, relu="no"), r"batch_norm 'batch_norm_0': relu must be True or False"),
    (lambda m, x: m.layer_norm(x, elementwise_affine=1), r"elementwise_affine must be True or False, got int 1"),
    (lambda m, x: m.dense(x, 2, use_bias=None), r"dense 'dense_0': use_bias must be True or False, got NoneType"),
    (lambda m, x: m.multihead_attention(m.input((4, 6, 8), name="q"), num_heads=2, causal="False"),
     r"multihead_attention 'multihead_attention_0': causal must be True or False"),
    # the mask hashes a seed's low 64 bits: 2**64 + 1 gave seed 1's
    (lambda m, x: m.dropout(x, 0.5, seed=2**64 + 1), r"dropout 'dropout_0': seed must be below 2\*\*64"),
    (lambda m, x: m.concat(x, axis=1), r"concat: tensors must be a list of tensors, got TensorSpec"),
])
def test_operator_attributes_are_checked_not_truncated(build, match):
    m = Model(Runtime(execute=False), weights=False)
    x = m.input((4, 3, 8, 8), name="x")
    with pytest.raises((TypeError, ValueError), match=match):
        build(m, x)
    assert len(m.ops) == 0


@pytest.mark.parametrize("dtype", ["complex64", "bool", "U3", "object"])
def test_a_model_input_holds_floats_or_integers(dtype):
    with pytest.raises(ValueError, match=rf"input dtype must be a float or integer dtype .*got '{dtype}'"):
        Model(seed=0).input((2, 3), dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "longdouble"])
def test_a_model_input_s_floats_are_those_the_kernels_compute_in(dtype):
    """float16 and longdouble built and compiled, then failed in a task with numba's error."""
    with pytest.raises(ValueError, match=rf"input dtype {np.dtype(dtype).name}: the operators compute in float32 "
                                         rf"or float64"):
        Model(seed=0).input((2, 3), dtype=dtype)


def test_weights_too_big_for_memory_name_their_op():
    """numpy's MemoryError named a float64 array of 224 GiB, not the op."""
    m = Model(seed=0)
    with pytest.raises(MemoryError, match=r"dense 'dense_0': its weights \(weight \[10000000000, 3\], bias "
                                          r"\[10000000000\], 149 GiB\) do not fit"):
        m.dense(m.input((4, 3)), 10**10)
    assert not m.ops


def test_data_that_is_not_finite_is_refused_before_any_work():
    """A NaN in a batch was trained on, with a warning after the update had made every weight NaN."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3)), np.zeros(4, "int64")
    with Runtime(cpus=1) as rt:
        m = _mlp(rt)
        before, issued = m.parameters(), rt.issued
        bad = x.copy()
        bad[2, 1] = np.nan
        with pytest.raises(ValueError, match=r"fit: input 'x' has nan at \(2, 1\): the data must be finite"):
            m.fit({"x": bad}, y, iterations=1, verbose=False)
        bad[2, 1] = -np.inf
        with pytest.raises(ValueError, match=r"predict: input 'x' has -inf at \(2, 1\)"):
            m.predict({"x": bad})
        with pytest.raises(ValueError, match=r"set_parameters: dense_0.bias has nan at \(1,\)"):
            m.set_parameters({"dense_0.bias": np.array([0.0, np.nan])})
        assert rt.issued == issued and m.step == 0
        for name, value in before.items():
            np.testing.assert_array_equal(m.parameters()[name], value)
        with pytest.raises(TaskError, match=r"train_on: source\(1, 0, 4\): input 'x' has inf"):
            list(m.train_on(lambda step, lo, hi: (np.full((hi - lo, 3), np.inf), y[lo:hi]), 1))
        assert m.step == 0
    with Runtime(cpus=1) as rt:
        m = Model(rt, seed=0)
        m.dense(m.input((4, 3), name="x"), 2)
        m.compile(loss="mean_squared_error")
        with pytest.raises(ValueError, match=r"fit: targets has nan at \(0, 0\)"):
            m.fit({"x": x}, np.full((4, 2), np.nan), iterations=1, verbose=False)


@pytest.mark.parametrize("build", [
    lambda m, x: m.dense(x, 3),
    lambda m, x: m.softmax(x),
    lambda m, x: m.relu(x),
    lambda m, x: m.dropout(x, 0.5),
    lambda m, x: m.layer_norm(x),
    lambda m, x: m.batch_matmul(m.reshape(x, (2, 2, 3)), m.reshape(x, (2, 3, 2))),
    lambda m, x: m.lstm(m.reshape(x, (2, 2, 3)), 4),
])
def test_arithmetic_ops_refuse_integer_inputs_when_built(build):
    """An int32 input into a dense layer used to build, and compile failed later on the loss's
    dtype; the op that needs floats now says so itself."""
    m = Model(seed=0)
    x = m.input((2, 6), dtype="int32", name="ids")
    with pytest.raises(ValueError, match=r"input ids(\.out)? must be floating point, got int32|"
                                         r"input reshape_\d\.out must be floating point, got int32"):
        build(m, x)


def test_integer_inputs_still_feed_embeddings_and_shape_ops():
    m = Model(seed=0)
    x = m.input((2, 6), dtype="int64", name="ids")
    assert m.embedding(m.reshape(x, (2, 3, 2)), 10, 4).shape == (2, 3, 2, 4)
    assert m.add(x, x).dtype == "int64"


@pytest.mark.parametrize("dtype", ["U4", "object", "datetime64[s]", "no-such-dtype"])
def test_a_region_holds_numbers(dtype):
    with pytest.raises(ValueError, match=r"region 'r': dtype must be numeric .*got"):
        Runtime(cpus=1, execute=False).region((2,), dtype=dtype, name="r")


def test_attach_refuses_an_array_that_would_lose_its_kind():
    """A complex array into a float region used to drop its imaginary parts with a warning."""
    with Runtime(cpus=1) as rt:
        r = rt.region((2, 2), name="r")
        with pytest.raises(ValueError, match=r"attach: an array of dtype complex64 does not convert"):
            rt.attach(r, np.ones((2, 2), np.complex64))
        rt.attach(r, np.arange(4, dtype=np.int64).reshape(2, 2)).wait()   # integers into floats: kept
        assert rt.read(r).tolist() == [[0, 1], [2, 3]]
        # float64 beyond float32's range became inf with numpy's warning alone; inf and nan stay what they are
        with pytest.raises(ValueError, match=r"attach: 1e\+300 at \(1, 0\) is beyond what .* float32 holds"):
            rt.attach(r, np.array([[1.0, np.inf], [1e300, np.nan]]))
        rt.attach(r, np.array([[1.0, np.inf], [-np.inf, np.nan]])).wait()
        assert np.isinf(rt.read(r)[1, 0]) and np.isnan(rt.read(r)[1, 1])


@pytest.mark.parametrize("value,dtype", [("x", "float32"), (None, "float32"), (1.5, "int32"), (1j, "float64")])
def test_fill_refuses_what_the_region_cannot_hold_before_any_task(value, dtype):
    """A string fill used to fail inside its task and stop the runtime."""
    with Runtime(cpus=1) as rt:
        r = rt.region((3,), dtype=dtype, name="r")
        with pytest.raises(ValueError, match=r"fill: .* is not a number that Region\('r'"):
            rt.fill(r, value)
        rt.fill(r, 2).wait()
        assert rt.read(r).tolist() == [2, 2, 2]


@pytest.mark.parametrize("value,dtype,ok", [(0, "uint8", True), (255, "uint8", True), (256, "uint8", False),
                                            (-1, "uint8", False), (2.0, "int32", True), (float("nan"), "int32", False),
                                            (float("-inf"), "float32", True), (1 + 2j, "complex64", True),
                                            (np.float64(0.5), "float16", True), (True, "bool", True), (2, "bool", False)])
def test_fill_takes_every_number_its_region_holds(value, dtype, ok):
    from taskrt.runtime import _holds
    assert _holds(np.dtype(dtype), value) == ok
