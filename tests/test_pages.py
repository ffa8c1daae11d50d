"""AppTest: every page renders without an exception, and runs open by ?run=ID."""
import pytest
from streamlit.testing.v1 import AppTest

from backend import experiments, record
from pages.catalog import SECTIONS
from tests.conftest import REPO

PAGES = [t.file for topics in SECTIONS.values() for t in topics]  # every page in the navigation


def _app(page=None, **params):
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    if page:
        at.switch_page(page)
    for k, v in params.items():
        at.query_params[k] = v
    return at.run()


@pytest.fixture(scope="module")
def finished_run():
    from backend import experiments
    from backend.store import RunStore

    exp = experiments.get("comm.bandwidth")
    config = exp.make_config({"world_size": "2", "max_bytes": "2048", "iters": "1", "ops": "all_reduce,broadcast"})
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), "pages-test", status="running")
    record.run_recorded(exp, config, experiments.RunContext(), store, rid)
    return rid


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
    from backend import experiments
    from backend.store import RunStore

    exp = experiments.get("collectives.run")
    config = exp.make_config({"world_size": "3", "numel": "31", "iters": "1"})
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), "pages-coll", status="running")
    record.run_recorded(exp, config, experiments.RunContext(), store, rid)
    at = _app("pages/collectives.py", run=rid)
    assert not at.exception
    assert at.slider[0].max == 3  # 2(n-1) steps: 0..3
    assert any("The ring all-gather indices as the notes write them" in w.value for w in at.info)
    at.slider[0].set_value(-1).run()
    assert not at.exception


def test_fusion_page_draws_graphs_source_and_memory_plan():
    from backend import experiments
    from backend.store import RunStore

    exp = experiments.get("graph.fusion")
    config = exp.make_config({"model": "ln_gelu"})
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), "pages-test", status="running")
    record.run_recorded(exp, config, experiments.RunContext(), store, rid)
    at = _app("pages/fusion.py", run=rid)
    assert not at.exception, at.exception
    assert any("@triton.jit" in c.value for c in at.code), ([c.value[:80] for c in at.code], [e.value for e in at.error], [s.value for s in at.subheader])
    assert any(m.label == "kernels launched" and m.value == "38 → 3" for m in at.metric)


def _recorded(name: str, settings: dict) -> str:
    from backend import experiments
    from backend.store import RunStore

    exp = experiments.get(name)
    config = exp.make_config(settings)
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), f"pages-{name}", status="running")
    record.run_recorded(exp, config, experiments.RunContext(timeout_s=120), store, rid)
    return rid


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


def test_serving_page_draws_the_cost_model_of_an_engine_run():
    """The engine run's cost model on the page: its paragraph (fit, designed steps, the noise's drifts) and its
    coefficient table, every term the fit has."""
    from backend.serving.simulator import TERMS

    rid = _recorded("serving.engine", {})
    at = _app("pages/serving.py", run=rid)
    assert not at.exception, at.exception
    assert any("designed steps" in md.value and "relative to the step's predicted time" in md.value for md in at.markdown)
    tables = [df.value for df in at.dataframe if "term" in df.value.columns]
    assert len(tables) == 1 and len(tables[0]) == len(TERMS) + 1  # the fitted terms and the measured swap cost
    assert "per step with two or more decodes" in set(tables[0]["term"])
