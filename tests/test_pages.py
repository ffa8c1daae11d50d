"""AppTest: every page renders without an exception, and runs open by ?run=ID."""
import re

import pytest

from backend import experiments
from pages.catalog import SECTIONS
from tests.sweep import open_page as _app, recorded as _recorded  # noqa: F401  (other tests' _app and _recorded)

PAGES = [t.file for topics in SECTIONS.values() for t in topics]  # every page in the navigation


@pytest.fixture(scope="module")
def finished_run():
    return _recorded("comm.bandwidth", {"world_size": "2", "max_bytes": "2048", "iters": "1", "ops": "all_reduce,broadcast"})


@pytest.fixture(scope="module")
def serving_run():
    """One engine run at the defaults (about 15 s), read by the serving page's tests."""
    return _recorded("serving.engine", {})


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders(page):
    at = _app(page)
    assert not at.exception, at.exception


def test_runs_page_opens_a_run_by_url(finished_run):
    at = _app("pages/runs.py", run=finished_run)
    assert not at.exception
    assert any(finished_run in s.value and "succeeded" in s.value for s in at.subheader)
    assert any("checks against independent references passed" in s.value for s in at.success)


def test_topic_page_draws_a_run_from_url(finished_run):
    at = _app("pages/comm_bandwidth.py", run=finished_run)
    assert not at.exception
    assert any("2 ranks on gloo" in m.value for m in at.markdown)


def _slowest_problems(result: dict) -> list[str]:
    """The run's slowest-rank counts against a recount from its per-rank times (pandas' idxmax, first rank on a tie):
    every rank of every collective has a row, and each count is the sizes at which that rank's time was the largest."""
    import pandas as pd

    per_rank = pd.DataFrame(result["tables"]["per_rank"])
    slowest = per_rank.loc[per_rank.groupby(["op", "size_bytes"], sort=False)["time_us"].idxmax()]
    expected = {(op, rank): 0 for op in per_rank["op"].unique() for rank in per_rank["rank"].unique()}
    expected.update(slowest.groupby(["op", "rank"]).size().to_dict())
    got = {(r["op"], r["rank"]): r["calls"] for r in result["tables"]["slowest"]}
    return [f"{key}: {got.get(key)} != {n}" for key, n in expected.items() if got.get(key) != n] + \
           [f"{key}: not a rank" for key in set(got) - set(expected)]


def test_bandwidth_run_counts_its_slowest_ranks(finished_run):
    from backend.store import RunStore

    result = RunStore().get(finished_run).result()
    assert _slowest_problems(result) == []
    first, *rest = result["tables"]["slowest"]  # one call counted at the wrong rank
    moved = [dict(first, calls=first["calls"] + 1), *rest]
    assert _slowest_problems({**result, "tables": {**result["tables"], "slowest": moved}})


def _factors_off(result: dict, world: int) -> float:
    """The largest gap between the run's bus factors and nccl-tests' (doc/PERFORMANCE.md: all-reduce 2(n−1)/n,
    broadcast 1), one row per collective the run timed, in its order."""
    published = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}
    rows = result["tables"]["bus_factors"]
    if [r["op"] for r in rows] != list(dict.fromkeys(r["op"] for r in result["tables"]["bandwidth"])):
        return float("inf")
    return max(abs(r["bus_factor"] - published[r["op"]]) for r in rows)


def test_bandwidth_run_holds_each_collectives_bus_factor_once(finished_run, monkeypatch):
    """The page's line on busbw reads the factors from the result (it grouped the rows before); a real run stored before
    them gains them by the upgrade; one factor for the whole sweep (its first row's) fails."""
    import json

    from backend.experiments.comm import bandwidth
    from backend.store import RunStore
    from tests.conftest import REPO

    assert _factors_off(RunStore().get(finished_run).result(), 2) < 1e-12
    four = experiments.run("comm.bandwidth", world_size=4, max_bytes=2048, iters=1, ops="all_reduce,broadcast")
    assert _factors_off({"tables": four.tables}, 4) < 1e-12  # all-reduce 1.5, broadcast 1: told apart
    old = json.loads((REPO / "tests" / "data" / "old_results" / "comm.bandwidth.json").read_text())
    assert "bus_factors" not in old["tables"] and old["config"]["world_size"] == 2
    assert _factors_off(bandwidth.RESULT.upgrade(old), 2) < 1e-12
    monkeypatch.setattr(bandwidth, "bus_factors", lambda table: [{"op": table[0]["op"], "bus_factor": table[0]["bus_factor"]}])
    assert _factors_off(bandwidth.RESULT.upgrade(old), 2) == float("inf")


def test_unknown_run_is_a_clear_message():
    at = _app("pages/runs.py", run="doesnotexist")
    assert not at.exception
    assert any("No run `doesnotexist`" in w.value for w in at.warning)


def test_bad_url_settings_are_named_and_not_run():
    at = _app("pages/comm_bandwidth.py", world_size="1000")
    assert not at.exception
    assert any("world_size: 1000 is out of range" in e.value for e in at.error)


def test_an_old_links_list_fills_the_form_and_a_bad_item_is_named():
    at = _app("pages/comm_bandwidth.py", world_size="2", ops="all_reduce,all_gather")
    assert not at.exception and not at.error
    assert at.text_input(key="comm.bandwidth.ops").value == "all_reduce,all_gather"
    at = _app("pages/comm_bandwidth.py", ops="all_reduce,gossip")
    assert any("ops: 'gossip' in 'all_reduce,gossip' is out of range (allowed: a comma-separated list of 1..5 names, "
               "each one of all_reduce" in e.value for e in at.error)


def test_collectives_page_replays_a_ring_run():
    rid = _recorded("comm.collectives", {"world_size": "3", "numel": "31", "iters": "1"})
    at = _app("pages/collectives.py", run=rid)
    assert not at.exception
    assert at.slider[0].max == 3  # 2(n-1) steps: 0..3
    assert any("The ring all-gather indices as the notes write them" in w.value for w in at.info)
    at.slider[0].set_value(-1).run()
    assert not at.exception


def test_fusion_page_draws_graphs_source_and_memory_plan():
    rid = _recorded("graph.fusion", {"model": "ln_gelu"})
    at = _app("pages/fusion.py", run=rid)
    assert not at.exception, at.exception
    assert any("@triton.jit" in c.value for c in at.code), ([c.value[:80] for c in at.code], [e.value for e in at.error], [s.value for s in at.subheader])
    assert any(m.label == "kernels launched" and m.value == "38 → 3" for m in at.metric)


def test_data_parallel_comparison_after_a_parameter_server_run():
    """A parameter-server run (no memory table) with the same settings must not break the ZeRO page's comparison."""
    base = {"world_size": "2", "hidden": "8", "layers": "2", "batch": "8", "steps": "2"}
    _recorded("parallel.dp_ps", base)
    rid = _recorded("parallel.zero", {**base, "stage": "2"})
    at = _app("pages/data_parallel.py", strategy="parallel.zero", run=rid)
    assert not at.exception, at.exception
    assert at.radio[0].value.startswith("ZeRO")


def test_a_topic_page_opens_on_its_defaults_run(monkeypatch):
    """A first visit starts the defaults' run (or finds it by its digest) and the page shows it, no click needed."""
    import time

    from backend.store import FINAL, RunStore

    monkeypatch.setenv("EXPLORER_OPEN_ON_DEFAULT_RUN", "1")
    first = _app("pages/autograd.py")
    assert not first.exception, first.exception
    run_id = first.query_params["run"]
    store = RunStore()
    deadline = time.monotonic() + 120
    while store.get(run_id).status not in FINAL and time.monotonic() < deadline:
        time.sleep(0.5)
    assert store.get(run_id).status == "succeeded" and store.get(run_id).config == experiments.get("graph.autodiff").config_cls().to_dict()
    again = _app("pages/autograd.py")  # another visitor: the same run, found by its digest, already drawn
    assert again.query_params["run"] == run_id
    assert any("checks against independent references passed" in s.value for s in again.success)


def test_a_stopped_run_shows_why_how_far_what_it_had_and_its_log():
    """What the page draws from a run the time limit stopped: the message naming the settings to lower, the
    progress it reached, its results so far and its log."""
    from backend import experiments, limits
    from backend.store import RunStore

    exp = experiments.get("attention.variants_train")
    config = exp.make_config({})
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), "pages-stopped", status="running")
    store.update(rid, progress=0.4, progress_msg="mqa step 20")
    store.write_partial(rid, {"note": "Training curves so far.", "metrics": {"entropy_rate_nats": 1.4},
                              "tables": {"curves": [{"variant": "mha", "step": 0, "loss": 2.9}]}})
    (store.run_dir(rid) / "log.txt").write_text("--- time limit: stack of the leader ---\n")
    store.finish(rid, "failed", error=limits.time_message(120, config))
    at = _app("pages/variants_train.py", run=rid)
    assert not at.exception, at.exception
    assert any("lower steps (now" in e.value for e in at.error), [e.value for e in at.error]
    assert any("Results so far" in s.value for s in at.subheader)
    assert any("Training curves so far." in c.value for c in at.caption)
    assert len(at.dataframe) == 2  # the metrics and the curves
    assert any("stack of the leader" in c.value for c in at.code)


def test_serving_page_draws_the_cost_model_of_an_engine_run(serving_run):
    """The engine run's cost model on the page: its paragraph (fit, designed steps, the noise's drifts) and its
    coefficient table, every term the fit has."""
    from backend.serving.simulator import TERMS

    at = _app("pages/serving.py", run=serving_run)
    assert not at.exception, at.exception
    assert any("designed steps" in md.value and "relative to the step's predicted time" in md.value for md in at.markdown)
    tables = [df.value for df in at.dataframe if "term" in df.value.columns]
    assert len(tables) == 1 and len(tables[0]) == len(TERMS) + 1  # the fitted terms and the measured swap cost
    assert "per step with two or more decodes" in set(tables[0]["term"])


def _chart_specs(at) -> list[dict]:
    """The Vega-Lite spec of every Altair chart the page drew."""
    import json

    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def _bars_on_log_axes(spec: dict) -> list[str]:
    """Bars (or areas) whose length runs along a log axis: a bar's length, and a stack's sum, mean nothing there."""
    found = []
    for view in [spec, *spec.get("layer", []), *spec.get("hconcat", []), *spec.get("vconcat", [])]:
        mark = view.get("mark", {})
        mark = mark.get("type") if isinstance(mark, dict) else mark
        enc = view.get("encoding", {})
        for axis in ("x", "y"):
            scale = enc.get(axis, {}).get("scale", {})
            if mark in ("bar", "area") and scale.get("type") == "log" and f"{axis}2" not in enc:
                found.append(f"{mark} on a log {axis} ({enc[axis].get('title')})")
    return found


def test_serving_page_one_verdict_a_whole_cost_table_and_linear_stacks(serving_run):
    """Issue #31 on the Serving page: the cost-model table is not squeezed into a column (its µs were cut), the batch
    composition is not drawn as bars on a log axis, and the fidelity figure gets one verdict (the run's note), not a
    second one in a caption."""
    at = _app("pages/serving.py", run=serving_run)
    assert not at.exception, at.exception
    assert all(len(col.dataframe) == 0 for col in at.columns), "a table squeezed into a column"
    specs = _chart_specs(at)
    assert any("Batch composition" in str(s.get("title")) for s in specs), [s.get("title") for s in specs]
    assert [p for s in specs for p in _bars_on_log_axes(s)] == []
    texts = [e.value for kind in ("markdown", "caption", "info", "success", "warning") for e in getattr(at, kind)]
    verdicts = [t for t in texts if re.search(r"\b(within|outside|meets|misses)\b.*%", t)]
    assert len(verdicts) == 1 and verdicts[0].startswith("Fidelity, simulated vs real"), verdicts
    assert [p for df, cfg in _page_tables(at) for p in table_problems(df, cfg)] == []


def test_bars_on_log_axes_are_found():
    """The rule above fails for the page's old batch chart (bars on a log axis, overlaid) and passes for a Gantt."""
    import altair as alt
    import pandas as pd

    df = pd.DataFrame({"a": [1, 2], "b": [3, 400], "c": [2, 3]})
    old = alt.Chart(df).mark_bar().encode(x="a:Q", y=alt.Y("b:Q", scale=alt.Scale(type="log"), stack=None)).to_dict()
    gantt = alt.Chart(df).mark_bar().encode(x=alt.X("a:Q", scale=alt.Scale(type="log")), x2="c:Q", y="b:N").to_dict()
    assert _bars_on_log_axes(old) and not _bars_on_log_axes(gantt)


# --- tables as a reader sees them (pages/ui.readable) ------------------------------------------------------------
SNAKE = re.compile(r"[a-z0-9]_[a-z0-9]")


def table_problems(df, columns: dict) -> list[str]:
    """What the grid would show a reader, from the frame and column configuration it is given (independent of
    pages/ui.py's rule): a snake_case header, a missing cell (drawn as a raw "None"), a float column without a format
    (drawn with every digit: 0.7723076534790962)."""
    import pandas as pd

    found = []
    for col in df.columns:
        cfg = columns.get(str(col)) or {}
        label = cfg.get("label") or str(col)
        if SNAKE.search(label):
            found.append(f"raw column name {label!r}")
        values = df[col]
        if (values.isna() | values.map(lambda v: isinstance(v, str) and not v.strip())).any():
            found.append(f"{label!r}: missing cells")
        if pd.api.types.is_float_dtype(values) and not (cfg.get("type_config") or {}).get("format"):
            found.append(f"{label!r}: floats without a format")
    return found


def _page_tables(at) -> list[tuple]:
    """Every table an AppTest page drew: its frame and its column configuration (as the grid receives it)."""
    import json

    return [(d.value, json.loads(d.proto.columns or "{}")) for d in at.dataframe]


def _sample_frame():
    import pandas as pd

    return pd.DataFrame({"level": ["registers", "L1"], "capacity_bytes": [28311552, 21233664], "ops": [None, 8.041237],
                         "forward_cpu_ms": [6.98123, 41.9861], "source": ["", "whitepaper"], "f": [[0.36787944117, 1.0], [2.0]]})


def test_readable_tables_have_words_for_names_formats_and_no_missing_cells():
    from pages.ui import readable

    raw = _sample_frame()
    assert len(table_problems(raw, {})) == 6  # the check fails on the raw frame: two names, two missing, two unformatted
    df, config = readable(raw)
    assert table_problems(df, config) == []
    assert config["forward_cpu_ms"]["label"] == "forward cpu (ms)" and config["capacity_bytes"]["label"] == "capacity (bytes)"
    assert list(df["ops"]) == ["—", "8.04"] and config["ops"]["alignment"] == "right"
    assert config["forward_cpu_ms"]["type_config"]["format"] == "%.2f"  # 3 significant digits of the smallest value
    assert list(df["f"]) == ["0.3679, 1", "2"]  # a vector's numbers, not 17 digits each


def test_readable_rule_broken_is_caught(monkeypatch):
    """With the rule broken (labels left as keys, missing cells left in), the check above fails."""
    import pages.tables as tables

    monkeypatch.setattr(tables, "words", lambda name: name)
    monkeypatch.setattr(tables, "MISSING", None)
    df, config = tables.readable(_sample_frame())
    problems = table_problems(df, config)
    assert any("raw column name" in p for p in problems) and any("missing cells" in p for p in problems)


def test_every_page_draws_its_tables_through_ui_table():
    """A table drawn with st.dataframe directly skips readable(): only pages/tables.py calls it (pages reach it as ui.table)."""
    import ast

    from tests.conftest import REPO

    direct = []
    for path in sorted((REPO / "pages").glob("*.py")):
        if path.name in ("ui.py", "tables.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("dataframe", "table"):
                if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "ui"):
                    direct.append(f"{path.name}:{node.lineno}")
    assert direct == []


def test_memory_hierarchy_roofs_differ_by_peak_and_its_tables_read():
    """Each GPU's two roofs (fp16 tensor, fp32) are told apart by dash, not drawn alike; no table shows None."""
    import pandas as pd

    rid = _recorded("hardware.roofline", {"seq_len": "256", "gemm_sizes": "64,128"})
    at = _app("pages/memory_hierarchy.py", run=rid)
    assert not at.exception, at.exception
    roof = next(s for s in _chart_specs(at) if "attainable FLOP/s" in json_text(s))
    line = next(layer for layer in roof["layer"] if "strokeDash" in layer.get("encoding", {}))
    dash = line["encoding"]["strokeDash"]
    assert "field" in dash, dash  # a condition on the device gave both of a GPU's roofs one dash
    dashes = dict(zip(dash["scale"]["domain"], map(tuple, dash["scale"]["range"])))
    from backend.store import RunStore

    roofs = pd.DataFrame(RunStore().get(rid).result()["tables"]["roofs"])
    assert (roofs[~roofs["device"].str.contains("measured")].groupby("device")["precision"].nunique() == 2).all()
    assert dashes["fp16/bf16 tensor (datasheet)"] != dashes["fp32 (datasheet)"]  # so each GPU's two roofs differ
    assert [p for df, cfg in _page_tables(at) for p in table_problems(df, cfg)] == []


def json_text(spec: dict) -> str:
    import json

    return json.dumps(spec)


def test_pipeline_page_splits_idle_time_and_says_why_the_wall_bubble_is_larger():
    rid = _recorded("parallel.pipeline", {"world_size": "2"})
    at = _app("pages/pipeline.py", run=rid)
    assert not at.exception, at.exception
    assert any("send/recv latency is visible" in c.value for c in at.caption)
    assert any("Idle time, per rank" in json_text(s) for s in _chart_specs(at))
    assert [p for df, cfg in _page_tables(at) for p in table_problems(df, cfg)] == []


def test_a_table_with_no_rows_is_a_sentence_not_an_empty_grid(monkeypatch):
    """The grid draws an empty table as one blank cell (the walk found one on Graph placement: no transfers)."""
    import pandas as pd

    import pages.ui as ui

    drawn = []
    monkeypatch.setattr(ui.st, "caption", lambda text: drawn.append(("caption", text)))
    monkeypatch.setattr(ui.st, "dataframe", lambda df, **kw: drawn.append(("dataframe", len(df))))
    ui.table(pd.DataFrame(columns=["src", "dst", "bytes"]))
    ui.table(pd.DataFrame({"src": [0], "dst": [1], "bytes": [64]}))
    assert drawn == [("caption", "None in this run."), ("dataframe", 1)]
