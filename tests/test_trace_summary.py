"""tools/trace_summary: per-processor busy time and utilization from a trace."""
import json

from tools.trace_summary import format_summary, main, summarize


def test_summary_adds_busy_time_per_processor():
    events = [
        {"proc": "r0.cpu0", "start": 0.0, "end": 40.0, "bytes": 8, "kind": "task"},
        {"proc": "r0.cpu0", "start": 50.0, "end": 100.0, "bytes": 8, "kind": "task"},
        {"proc": "r0.cpu1", "start": 10.0, "end": 35.0, "bytes": 0, "kind": "task"},
        {"proc": "r0.sys0->r0.sys1", "start": 40.0, "end": 45.0, "bytes": 4096, "kind": "copy"},
    ]
    s = summarize(events)
    assert s["span_us"] == 100.0
    cpu0 = s["by_proc"]["r0.cpu0"]
    assert cpu0["count"] == 2 and cpu0["busy_us"] == 90.0 and cpu0["utilization"] == 0.9
    channel = s["by_proc"]["r0.sys0->r0.sys1"]
    # a channel's copies are its busy time (5 us of 100): left out, it read idle
    assert channel["bytes"] == 4096 and channel["busy_us"] == 5.0 and channel["utilization"] == 0.05
    text = format_summary(s)
    assert "r0.cpu1" in text and "25%" in text


def test_empty_trace_and_command_line(tmp_path, capsys):
    assert summarize([]) == {"span_us": 0, "by_proc": {}}
    path = tmp_path / "t.jsonl"
    lines = [{"kind": "meta", "rank": 0}, {"id": 1, "name": "t", "kind": "task", "op": "", "rank": 0,
                                          "proc": "r0.cpu0", "start": 1.0, "end": 3.0, "bytes": 0}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    main([str(path)])
    assert "r0.cpu0" in capsys.readouterr().out
