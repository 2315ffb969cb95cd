"""apps/demo: the stencil matches NumPy exactly and the small CNN learns, both traced."""
from apps.demo import run, train_cnn
from taskrt.tracing import read_trace


def test_demo_stencil_and_cnn(tmp_path):
    out = run(cpus=2, size=48, steps=8, trace=str(tmp_path / "demo.trace.jsonl"))
    assert out["max_error"] == 0.0
    assert out["replay"]["replayed"] >= 1
    assert any(e["kind"] == "copy" for e in out["events"])
    cnn = train_cnn(cpus=2, iterations=12, trace=str(tmp_path / "cnn.trace.jsonl"))
    assert cnn["loss_last"] < cnn["loss_first"]
    _, events = read_trace(str(tmp_path / "cnn.trace.jsonl"))
    assert {e["op"] for e in events} >= {"conv1", "fc"}
