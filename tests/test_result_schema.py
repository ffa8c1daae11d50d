"""Result schemas (issue #32): an experiment declares its result's metrics, tables and columns once (backend.result.Schema,
beside the experiment); every run is stamped with it, every stored run is opened through it (upgraded from the version
it was stored in), and a page reads only the keys its experiments declare."""
import ast
import dataclasses
import json

import pytest

from backend import experiments
from backend.result import VERSION_KEY, Result, Schema, Shapes, UndeclaredKey
from backend.store import RunStore
from pages.catalog import SECTIONS
from tests.conftest import REPO

OLD_RESULTS = REPO / "tests" / "data" / "old_results"  # result.json files as runs stored them before schemas existed
VIEWS = {"decode_view": ("hardware.decode",), "int8_view": ("numerics.int8",), "latency_view": ("hardware.latency",),
         "recompute_view": ("parallel.pipeline",), "checkpoint_views": ("parallel.checkpoint", "parallel.mesh"),
         "mesh_views": ("parallel.mesh",), "schedule_views": ("parallel.mesh",), "plan_views": ("plan.training",)}
TOY = Schema(metrics=("a", "b", "per_op.*"), tables={"t": ("x", "y")}, optional=("b",))


def _toy(metrics=None, tables=None) -> Result:
    return Result(metrics={"a": 1, "per_op.ring": 2} if metrics is None else metrics,
                  tables={"t": [{"x": 1, "y": 2}]} if tables is None else tables)


# --- the mechanism ----------------------------------------------------------------------------------------------
def test_a_result_that_matches_its_schema_is_stamped_with_the_version():
    result = TOY.stamp(_toy(), "toy")
    assert result.schema_version == 1 and result.to_dict()[VERSION_KEY] == 1


@pytest.mark.parametrize("metrics, tables, problem", [
    ({"a": 1, "per_op.ring": 2, "c": 3}, None, "metric 'c' is not declared"),
    ({"per_op.ring": 2}, None, "metric 'a' is missing"),
    ({"a": 1}, None, "metric 'per_op.*' is missing"),  # a family needs one member
    (None, {"t": [], "u": []}, "table 'u' is not declared"),
    (None, {}, "table 't' is missing"),
    (None, {"t": [{"x": 1, "z": 2}]}, "table 't' has undeclared columns ['z']"),
])
def test_a_result_off_its_schema_is_refused_naming_the_key(metrics, tables, problem):
    with pytest.raises(UndeclaredKey, match="toy's result does not match") as info:
        TOY.stamp(_toy(metrics, tables), "toy")
    assert problem in str(info.value)


def test_optional_keys_may_be_absent_and_families_match_by_prefix():
    assert TOY.problems({"a": 1, "b": 2, "per_op.tree": 1, "per_op.ring": 2}, {"t": []}) == []
    assert TOY.declares("metrics", "per_op.anything") and not TOY.declares("metrics", "per_opx")


def test_a_page_reading_an_undeclared_key_is_refused_even_when_the_run_holds_it():
    opened = TOY.open({"metrics": {"a": 1, "c": 3}, "tables": {"t": []}}, "toy")
    assert opened["metrics"]["a"] == 1 and opened["metrics"].get("a") == 1 and "a" in opened["metrics"]
    for read in (lambda m: m["c"], lambda m: m.get("c"), lambda m: "c" in m):
        with pytest.raises(UndeclaredKey, match="'c' is not declared in toy's result schema"):
            read(opened["metrics"])
    with pytest.raises(UndeclaredKey):
        opened["tables"]["u"]


def test_upgrades_run_one_step_at_a_time_from_the_stored_version_on_a_copy():
    steps = []
    schema = Schema(metrics=("a",), tables={}, version=3,
                    upgrades={1: lambda r: steps.append(1) or r["metrics"].setdefault("a", 0), 2: lambda r: steps.append(2)})
    stored = {"metrics": {}, "tables": {}}
    assert schema.upgrade(stored) == {"metrics": {"a": 0}, "tables": {}, VERSION_KEY: 3} and steps == [1, 2]
    assert stored == {"metrics": {}, "tables": {}}, "the stored result is never rewritten"
    steps.clear()
    schema.upgrade({"metrics": {"a": 1}, "tables": {}, VERSION_KEY: 2})
    assert steps == [2]
    with pytest.raises(ValueError, match="newer than this code's 3"):
        schema.upgrade({"metrics": {}, "tables": {}, VERSION_KEY: 4})


def test_a_schema_without_an_upgrade_for_each_older_version_is_refused():
    with pytest.raises(ValueError, match=r"no upgrade from version\(s\) \[2\]"):
        Schema(metrics=(), tables={}, version=3, upgrades={1: lambda r: None})
    with pytest.raises(ValueError, match="optional keys the schema does not declare"):
        Schema(metrics=("a",), tables={}, optional=("b",))


def test_a_result_of_one_shape_is_held_to_that_shapes_keys():
    """An experiment with two result shapes (ddp/zero/fsdp: the MLP's or the mesh's): the shape the result names
    requires its keys and refuses the other's; a result naming no shape is refused; a page reading the other shape's key
    from a stored run is refused."""
    shapes = Shapes(by="model", shapes={"a": Schema(metrics=("model", "x"), tables={}),
                                        "b": Schema(metrics=("model", "y"), tables={"t": ("c",)})})
    shapes.stamp(Result(metrics={"model": "a", "x": 1}), "toy")
    for metrics, tables, problem in [({"model": "a"}, {}, "metric 'x' is missing"),
                                     ({"model": "a", "x": 1, "y": 2}, {}, "metric 'y' is not declared"),
                                     ({"model": "b", "y": 2}, {}, "table 't' is missing"),
                                     ({"model": "c", "x": 1}, {}, "metric 'model' is 'c' (allowed: a, b)")]:
        with pytest.raises(UndeclaredKey, match=problem.replace("(", r"\(").replace(")", r"\)")):
            shapes.stamp(Result(metrics=metrics, tables=tables), "toy")
    opened = shapes.open({"metrics": {"model": "b", "y": 2}, "tables": {"t": []}}, "toy")
    assert opened["metrics"]["y"] == 2 and shapes.declares("metrics", "x")
    with pytest.raises(UndeclaredKey, match="'x' is not declared"):
        opened["metrics"]["x"]
    with pytest.raises(ValueError, match="do not require the metric 'model'"):
        Shapes(by="model", shapes={"a": Schema(metrics=("x",), tables={})})


def test_a_version_1_mlp_run_opens_as_the_mlp_shape():
    """A parallel.zero run stored by version 1 (before the MLP's result named its model) opens through the MLP's shape
    (the upgrade names it); without that upgrade step it names no shape."""
    stored = json.loads((OLD_RESULTS / "v1" / "parallel.zero.json").read_text())
    schema = experiments.get("parallel.zero").schema
    assert stored[VERSION_KEY] == 1 and "model" not in stored["metrics"]
    opened = schema.open(stored, "parallel.zero")
    assert opened["metrics"]["model"] == "mlp" and opened["metrics"]["parameter_bytes"] == 320
    assert schema.shapes["mlp"].problems(opened["metrics"], opened["tables"]) == []
    nothing = {1: lambda result: None}  # the upgrade step does nothing
    broken = Shapes(by="model", shapes={k: dataclasses.replace(s, upgrades=nothing) for k, s in schema.shapes.items()})
    with pytest.raises(UndeclaredKey, match="metric 'model' is None"):
        broken.open(stored, "parallel.zero")


# --- every declared key is produced, every produced key declared ------------------------------------------------
CHEAP = {"models.moe_routing": {"tokens": 64, "bias_steps": 2}, "rl.bellman": {}, "numerics.formats": {},
         "graph.autodiff": {}, "hardware.gemm": {}}


@pytest.mark.parametrize("name", CHEAP)
def test_the_defaults_produce_every_declared_key_and_no_other(name):
    exp = experiments.get(name)
    result = exp.run(exp.make_config(CHEAP[name]))
    assert result.schema_version == exp.schema.version
    assert exp.schema.problems(result.metrics, result.tables) == []
    declared = [k for k in exp.schema.metrics if k not in exp.schema.optional]
    assert all(any(k == d or (d.endswith(".*") and k.startswith(d[:-1])) for k in result.metrics) for d in declared)


def _with_schema(monkeypatch, name: str, **change) -> experiments.Experiment:
    """The registered experiment `name` with its schema changed (the registry's entry replaced for this test)."""
    exp = experiments.get(name)
    changed = dataclasses.replace(exp, schema=dataclasses.replace(exp.schema, **change))
    monkeypatch.setitem(experiments._REGISTRY, exp.name, changed)
    return changed


def test_a_run_missing_a_declared_key_or_holding_an_undeclared_one_fails(monkeypatch):
    exp = experiments.get("rl.bellman")
    more = _with_schema(monkeypatch, "rl.bellman", metrics=(*exp.schema.metrics, "never_measured"))
    with pytest.raises(UndeclaredKey, match="metric 'never_measured' is missing"):
        more.run(more.make_config({}))
    fewer = _with_schema(monkeypatch, "rl.bellman", metrics=tuple(k for k in exp.schema.metrics if k != "V.sunny"))
    with pytest.raises(UndeclaredKey, match="metric 'V.sunny' is not declared"):
        fewer.run(fewer.make_config({}))


# --- every key a page reads is declared -------------------------------------------------------------------------
def _kind(node) -> str | None:
    """'metrics' or 'tables' when `node` is a result's metrics or tables: m, t, metrics, tables, X["metrics"]."""
    if isinstance(node, ast.Name):
        return {"m": "metrics", "metrics": "metrics", "t": "tables", "tables": "tables"}.get(node.id)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in ("metrics", "tables"):
        return node.slice.value
    return None


def page_reads(source: str) -> set[tuple[str, str]]:
    """(metrics | tables, key) a page reads with a constant key: m[...], t[...], metrics[...], tables[...],
    result["metrics"][...], their .get(...) and `in`; an f-string key gives its constant prefix ending in '*'."""
    kind = _kind

    def key(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return node.values[0].value + "*"  # f"gate_mean.{b}": some key of that family
        return None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript):
            pair = kind(node.value), key(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            pair = kind(node.func.value), key(node.args[0])
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            pair = kind(node.comparators[0]), key(node.left)
        else:
            continue
        if all(pair):
            found.add(pair)
    return found


def _declared_by(schemas: list[Schema], kind: str, key: str) -> bool:
    if key.endswith("*"):  # a family read: some declared key (or family) begins with its prefix
        names = [n for s in schemas for n in (s.metrics if kind == "metrics" else s.tables)]
        return any(n.startswith(key[:-1]) or (n.endswith(".*") and key[:-1].startswith(n[:-1])) for n in names)
    return any(s.declares(kind, key) for s in schemas)


def undeclared_reads(page: str, names: tuple[str, ...]) -> list[str]:
    schemas = [experiments.get(n).schema for n in names]
    source = (REPO / "pages" / f"{page}.py").read_text()
    return sorted(f"{kind} {key!r}" for kind, key in page_reads(source) if not _declared_by(schemas, kind, key))


def _schema_pages() -> dict[str, tuple[str, ...]]:
    """Every page (and view) whose experiments all declare a schema, with those experiments."""
    pages = {t.url_path: t.experiments for topics in SECTIONS.values() for t in topics if t.experiments}
    pages.update(VIEWS)
    return {page: names for page, names in pages.items() if all(experiments.get(n).schema for n in names)}


@pytest.mark.parametrize("page, names", sorted(_schema_pages().items()))
def test_every_key_a_page_reads_is_declared_by_its_experiments(page, names):
    assert undeclared_reads(page, names) == [], f"pages/{page}.py reads keys {names} do not declare"


# --- every table column a page reads is declared -----------------------------------------------------------------
def _table_of(node, tables: dict) -> str | None:
    """The table whose rows `node` holds: t["name"], result["tables"]["name"], a row of it (x[0], x[i]) or rows of it
    (x[mask]), a DataFrame of it (pd.DataFrame(x)), or a name bound to one of these in this scope."""
    if isinstance(node, ast.Name):
        return tables.get(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "DataFrame" and node.args:
        return _table_of(node.args[0], tables)
    if isinstance(node, ast.Subscript):
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) and _kind(node.value) == "tables":
            return node.slice.value
        if not (isinstance(node.slice, (ast.Constant, ast.List)) and not isinstance(getattr(node.slice, "value", 0), int)):
            return _table_of(node.value, tables)  # a row by position (x[0], x[-1], x[i]) or rows by a mask or slice
    return None


def _made_here(tree) -> set[str]:
    """Columns a page makes itself: x["c"] = ..., .assign(c=...), melt's var_name/value_name, rename's new names,
    agg's named outputs; reading those is not reading the result."""
    made = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            made.add(node.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            made |= {k.arg for k in node.keywords if node.func.attr in ("assign", "agg") and k.arg}
            made |= {k.value.value for k in node.keywords if k.arg in ("var_name", "value_name", "name")
                     and isinstance(k.value, ast.Constant)}
            for k in node.keywords:
                if k.arg == "columns" and isinstance(k.value, ast.Dict):
                    made |= {v.value for v in k.value.values if isinstance(v, ast.Constant)}
    return made


def _scopes(tree):
    """The module and each function: where a name is bound to one table."""
    yield tree
    yield from (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda)))


def column_reads(source: str) -> set[tuple[str, str]]:
    """(table, column) a page reads with a constant key from a table's rows or a DataFrame of them: x["c"], x.get("c"),
    x[["c", ...]], where x is a table, a row, a DataFrame of it or a name bound once in its scope to one of those
    (for-loop and comprehension variables over a table included). Columns the page makes itself are left out."""
    tree = ast.parse(source)
    found = set()
    for scope in _scopes(tree):
        bound: dict[str, set] = {}
        for node in ast.walk(scope):
            pairs = []
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                    pairs = list(zip(target.elts, value.elts))
                else:
                    pairs = [(target, value)]
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs = [(node.target, ast.Subscript(value=node.iter, slice=ast.Constant(0)))]  # each item: a row
            for target, value in pairs:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, set()).add(_table_of(value, {}) or _table_of(value, {k: next(iter(v)) for k, v in bound.items() if len(v) == 1 and None not in v}))
        tables = {k: next(iter(v)) for k, v in bound.items() if len(v) == 1 and None not in v}
        for node in ast.walk(scope):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                table, keys = _table_of(node.value, tables), node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
                table, keys = _table_of(node.func.value, tables), node.args[0]
            else:
                continue
            if table is None or (isinstance(node, ast.Subscript) and _kind(node.value) == "tables"):
                continue
            elts = keys.elts if isinstance(keys, ast.List) else [keys]
            found |= {(table, k.value) for k in elts if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    made = _made_here(tree)
    return {(t, c) for t, c in found if c not in made}


def undeclared_columns(page: str, names: tuple[str, ...]) -> list[str]:
    schemas = [experiments.get(n).schema for n in names]
    source = (REPO / "pages" / f"{page}.py").read_text()
    return sorted(f"{table}[{column!r}]" for table, column in column_reads(source)
                  if not any(column in s.tables.get(table, ()) for s in schemas))


@pytest.mark.parametrize("page, names", sorted(_schema_pages().items()))
def test_every_table_column_a_page_reads_is_declared_by_its_experiments(page, names):
    assert undeclared_columns(page, names) == [], f"pages/{page}.py reads columns {names} do not declare"


def test_pages_with_schemas_cover_the_topics_of_this_pass():
    assert {"comm_bandwidth", "collectives", "kv_cache", "flash_attention", "memory_hierarchy", "speculative",
            "moe_routing", "number_formats", "fusion", "paged_attention", "decode_view"} <= set(_schema_pages())
    assert {"plan_training", "tensor_parallel", "context_parallel", "expert_parallel", "checkpoints", "data_parallel",
            "pipeline", "recompute_view", "mesh_parallel", "mesh_views", "schedule_views", "checkpoint_views"} <= set(_schema_pages())


def test_a_page_reading_an_undeclared_key_is_found(monkeypatch):
    assert page_reads('m, t = result["metrics"], result["tables"]\nm["x"]; t.get("y"); "z" in result["metrics"]; '
                      'm[f"gate.{b}"]') == {("metrics", "x"), ("tables", "y"), ("metrics", "z"), ("metrics", "gate.*")}
    exp = experiments.get("decoding.speculative")
    _with_schema(monkeypatch, exp.name, metrics=tuple(k for k in exp.schema.metrics if k != "alpha"))
    assert undeclared_reads("speculative", (exp.name,)) == ["metrics 'alpha'"]


def test_every_page_file_that_reads_a_result_is_checked():
    """A page or view file reading result keys is in the catalog or VIEWS (else the checks above never see it)."""
    reading = {p.stem for p in (REPO / "pages").glob("*.py")
               if page_reads(p.read_text()) or column_reads(p.read_text())}
    assert reading - set(_schema_pages()) == set()


def test_a_page_reading_an_undeclared_column_is_found(monkeypatch):
    source = ('g = pd.DataFrame(result["tables"]["grads"])\ng["made"] = g["a"] - g["b"]\nfirst = t["runs"][0]\n'
              'first.get("c"); g[["made", "d"]]\nfor r in t["runs"]:\n    r["e"]\n[q["f"] for q in t["steps"]]\n'
              'x = t["runs"]\nx = 3\nx["not a table"]')
    assert column_reads(source) == {("grads", "a"), ("grads", "b"), ("grads", "d"), ("runs", "c"), ("runs", "e"),
                                    ("steps", "f")}
    exp = experiments.get("graph.autodiff")
    _with_schema(monkeypatch, exp.name, tables={**exp.schema.tables, "forward_dot": ()})
    assert undeclared_columns("autograd", (exp.name,)) == ["forward_dot['dot']"]


# --- old stored runs open, upgraded in one place ----------------------------------------------------------------
def _old(name: str) -> dict:
    return json.loads((OLD_RESULTS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(p.stem for p in OLD_RESULTS.glob("*.json")))
def test_a_real_old_result_is_upgraded_to_the_current_version(name):
    stored = _old(name)
    schema = experiments.get(name).schema
    assert VERSION_KEY not in stored and schema.version > 1, "a result stored before schemas, of a schema with an upgrade"
    upgraded = schema.upgrade(stored)
    assert upgraded[VERSION_KEY] == schema.version
    missing = [p for p in schema.problems(upgraded["metrics"], upgraded["tables"]) if "missing" in p]
    assert missing == []
    assert [p for p in schema.problems(stored["metrics"], stored["tables"]) if "missing" in p], \
        "the old result lacks something the upgrade supplies (else it tests nothing)"


def _store_old_run(name: str) -> str:
    """A run recorded in the test store with a real result.json from before schemas (no version, older keys)."""
    body, store = _old(name), RunStore()
    rid = store.create(body["experiment"], body["config"], f"old-format-{name}", status="running")  # maybe an old name
    path = store.run_dir(rid) / "result.json"
    path.write_text(json.dumps(body))
    store.finish(rid, "succeeded", result_path=str(path))
    return rid


# experiment -> its page, and what the page draws from the upgrade (a caption saying what the old run lacks, or the
# cost model's paragraph written from the old run's own metrics)
OLD_PAGES = {"comm.bandwidth": ("pages/comm_bandwidth.py", "did not count its slowest ranks"),
             "hardware.roofline": ("pages/memory_hierarchy.py", "did not table every preset's hierarchy"),
             "attention.kv_cache": ("pages/kv_cache.py", "did not draw the dataflow"),
             "serving.engine": ("pages/serving.py", "Fitted by least squares to **"),
             "parallel.pipeline": ("pages/pipeline.py", "did not list the other schedules' settings")}


@pytest.mark.parametrize("name", OLD_PAGES)
def test_an_old_stored_run_draws_on_its_page(name):
    from tests.test_pages import _app

    page, drawn = OLD_PAGES[name]
    at = _app(page, run=_store_old_run(name))
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)
    assert any(drawn in c.value for c in [*at.caption, *at.markdown]), drawn


@pytest.mark.parametrize("name, lacking", [("comm.bandwidth", "slowest"), ("parallel.pipeline", "side_by_side")])
def test_an_old_stored_run_fails_to_draw_without_its_upgrade(monkeypatch, name, lacking):
    from tests.test_pages import _app

    later = experiments.get(name).schema.upgrades
    _with_schema(monkeypatch, name, upgrades={**later, 1: lambda result: None})  # the first upgrade step does nothing
    at = _app(OLD_PAGES[name][0], run=_store_old_run(name))
    assert at.exception and lacking in str(at.exception[0].value)


def test_the_cli_shows_an_old_run_upgraded(capsys):
    from backend.__main__ import main

    rid = _store_old_run("hardware.roofline")  # stored under its old name, memory.roofline
    assert main(["show", rid, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["experiment"] == "memory.roofline" and shown["metrics"]["ridge_4090_fp32_flops_per_byte"] is None


# pages of the parallel and plan pass that no topic test draws: a recorded run of each read through its schema
@pytest.mark.parametrize("page, name, settings", [
    ("pages/plan_training.py", "plan.training", {}),
    ("pages/plan_training.py", "plan.search", {}),
    ("pages/checkpoints.py", "parallel.checkpoint", {}),
    ("pages/checkpoints.py", "parallel.checkpoint", {"kill_rank": "-1", "reshard_to": "off"}),  # its optional keys absent
])
def test_a_recorded_run_draws_reading_only_declared_keys(page, name, settings):
    from tests.sweep import render_recorded

    render_recorded(page, name, **settings)


def test_a_stored_mlp_run_draws_on_the_data_parallel_page():
    """The MLP is retired (model=mlp refused by name), yet a run stored with it opens and draws on its page: memory per
    rank, the loss, the bytes, the model named as the retired MLP."""
    from tests.test_pages import _app

    body, store = json.loads((OLD_RESULTS / "v1" / "parallel.zero.json").read_text()), RunStore()
    rid = store.create(body["experiment"], body["config"], "old-mlp-parallel.zero", status="running")
    path = store.run_dir(rid) / "result.json"
    path.write_text(json.dumps(body))
    store.finish(rid, "succeeded", result_path=str(path))
    at = _app("pages/data_parallel.py", strategy="parallel.zero", run=rid)
    assert not at.exception, at.exception
    assert any("retired Linear+tanh MLP" in c.value for c in at.caption)
    assert len(at.get("vega_lite_chart")) >= 2  # memory per rank, the loss
