import json
import time

from backend.trace import Tracer, to_chrome_trace


def _nests(events):
    """On one (pid, tid), any two complete events are disjoint or one contains the other."""
    by_lane = {}
    for e in events:
        by_lane.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1]:
                return False
            stack.append(end)
    return True


def test_export_parses_and_nests():
    events = []
    for rank in range(2):
        t = Tracer(rank)
        with t.span("compute", "step"):
            with t.span("compute", "forward"):
                time.sleep(0.001)
            with t.span("compute", "backward"):
                time.sleep(0.001)
        with t.span("send", "send", bytes=16):
            pass
        events += t.events
    trace = json.loads(json.dumps(to_chrome_trace(events)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 8
    meta = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {(0, "process_name"), (1, "thread_name"), (1, "process_sort_index")} <= meta
    assert _nests(xs)


def test_nesting_check_can_fail():
    bad = [{"pid": 0, "tid": 0, "ts": 0, "dur": 10}, {"pid": 0, "tid": 0, "ts": 5, "dur": 10}]
    assert not _nests(bad)
