"""What the mesh, pipeline and planning pages used to compute or look up themselves now comes from the run's result or
the frame (issue #32, pages only draw): the mesh's graph, the pipeline's side-by-side settings, the model upload, a
refused submit; and runs stored before the result held them still open, with a one-line "run it again" caption."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.config import ConfigError
from backend.store import QueueFull, RunStore

EDGE = re.compile(r'"(\d+)" -> "(\d+)" \[label="(\w+)" color="(#[0-9a-f]{6})"\]')
NODE = re.compile(r'"(\d+)" \[label="([^"]*)"\]')


def _edges(dot: str) -> set[tuple[int, int, str]]:
    return {(int(a), int(b), dim) for a, b, dim, _ in EDGE.findall(dot)}


def test_mesh_graph_chains_each_process_group_through_its_ranks():
    """tp 2 x pp 2 on 4 ranks, written out by hand: tp joins neighbours (0-1, 2-3), pp the stages (0-2, 1-3)."""
    from backend.experiments.parallel.mesh import mesh_graph

    ranks = [{"rank": r, "pp": r // 2, "dp": 0, "cp": 0, "ep": 0, "tp": r % 2, "layers": 2} for r in range(4)]
    groups = [{"dimension": "pp", "group": 0, "ranks": [0, 2]}, {"dimension": "pp", "group": 1, "ranks": [1, 3]},
              {"dimension": "tp", "group": 0, "ranks": [0, 1]}, {"dimension": "tp", "group": 1, "ranks": [2, 3]}]
    dot = mesh_graph(ranks, groups)
    assert _edges(dot) == {(0, 1, "tp"), (2, 3, "tp"), (0, 2, "pp"), (1, 3, "pp")}
    colors = {(dim, color) for *_, dim, color in EDGE.findall(dot)}
    assert len(colors) == 2 and len({color for _, color in colors}) == 2  # one colour per dimension, each its own
    labels = dict(NODE.findall(dot))
    assert labels["3"] == r"rank 3\ntp 1 · dp 0 · pp 1 · cp 0 · ep 0\n2 blocks"


def test_mesh_page_draws_the_runs_graph_and_opens_runs_stored_before_it():
    from tests.sweep import render_recorded
    from tests.test_pages import _app

    at = render_recorded("pages/mesh_parallel.py", "parallel.mesh", world_size="2", pp="1", tp="2", layers="2", steps="2")
    run_id = at.query_params["run"][0] if isinstance(at.query_params["run"], list) else at.query_params["run"]
    path = Path(RunStore().get(run_id).result_path)
    result = json.loads(path.read_text())
    assert _edges(result["tables"]["graph_dot"][0]["dot"]) == {(0, 1, "tp")}  # two ranks, one tp group
    assert len(at.get("graphviz_chart")) == 1
    del result["tables"]["graph_dot"], result["schema_version"]  # as a run stored before it (version 1)
    path.write_text(json.dumps(result))
    old = _app("pages/mesh_parallel.py", run=run_id)
    assert not old.exception, old.exception
    assert len(old.get("graphviz_chart")) == 0 and any("did not draw the mesh's process groups" in c.value for c in old.caption)


def test_pipeline_page_offers_every_other_schedule_from_the_result_and_opens_runs_stored_before_it():
    """The run holds its settings under each other schedule, the options that schedule lacks turned off (here:
    recompute, built for naive, GPipe and 1F1B only: the Config's help); each is a valid run's settings."""
    from backend import experiments
    from tests.sweep import render_recorded
    from tests.test_pages import _app

    at = render_recorded("pages/pipeline.py", "parallel.pipeline", world_size="2", recompute="true", layers="4",
                         microbatches="4", batch="16", hidden="32")
    run_id = at.query_params["run"][0] if isinstance(at.query_params["run"], list) else at.query_params["run"]
    written = ["naive", "gpipe", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "pipedream"]  # every one but 1f1b
    box = next(s for s in at.selectbox if s.label == "compare with schedule")
    assert list(box.options) == written
    path = Path(RunStore().get(run_id).result_path)
    result = json.loads(path.read_text())
    rows = {row["schedule"]: row for row in result["tables"]["side_by_side"]}
    assert {s: rows[s]["recompute"] for s in written} == {"naive": True, "gpipe": True, "interleaved_1f1b": False, "zb_h1": False,
                                                          "zb_v": False, "dualpipe_v": False, "pipedream": False}
    for row in rows.values():
        experiments.get("parallel.pipeline").make_config(row)  # refused settings would raise ConfigError here
    del result["tables"]["side_by_side"], result["schema_version"]  # as a run stored before it (version 1)
    path.write_text(json.dumps(result))
    old = _app("pages/pipeline.py", run=run_id)
    assert not old.exception, old.exception
    assert not [s for s in old.selectbox if s.label == "compare with schedule"]
    assert any("did not list the other schedules' settings" in c.value for c in old.caption)


@pytest.mark.parametrize("refusal", [ConfigError("microbatches", "3 is fewer than world_size=4 (allowed: >= 4)"),
                                     QueueFull("someone", 3, 3)])
def test_submit_shows_a_refusal_and_starts_nothing(monkeypatch, refusal):
    import pages.ui as ui

    def refuse(name, settings, owner=None):
        raise refusal

    shown = []
    monkeypatch.setattr(ui, "runner", lambda: SimpleNamespace(submit=refuse))
    monkeypatch.setattr(ui, "current_user", lambda: "someone")
    monkeypatch.setattr(ui.st, "error", shown.append)
    assert ui.submit("parallel.pipeline", {"microbatches": 3}) is None
    assert shown == [ui.escape(str(refusal))]  # the message as raised: it names the field (or the queue's cap)
    monkeypatch.setattr(ui, "runner", lambda: SimpleNamespace(submit=lambda name, settings, owner=None: f"{owner}:{name}"))
    assert ui.submit("parallel.pipeline", {}) == "someone:parallel.pipeline"  # started as the signed-in user


def _upload(monkeypatch, data: bytes) -> SimpleNamespace:
    """The model upload drawn with a stand-in for Streamlit that hands it `data` as the uploaded file."""
    import pages.form as form

    fake = SimpleNamespace(query_params={}, session_state={}, errors=[], captions=[],
                           file_uploader=lambda *a, **k: SimpleNamespace(getvalue=lambda: data))
    fake.error, fake.caption = fake.errors.append, fake.captions.append
    monkeypatch.setattr(form, "st", fake)
    return fake


def test_model_config_upload_stores_the_file_and_selects_it_by_its_hash(monkeypatch, tmp_path):
    import hashlib

    import pages.form as form
    from backend.plan import models

    good = (models.CONFIG_DIR / "llama-3-8b.json").read_bytes()
    fake = _upload(monkeypatch, good)
    form.model_config_upload("plan.training", tmp_path)
    digest = hashlib.sha256(good).hexdigest()  # the content hash, computed here
    assert fake.query_params == {"model": digest} and fake.session_state == {"plan.training.model": digest}
    assert (tmp_path / "models" / "uploads" / f"{digest}.json").read_bytes() == good and not fake.errors
    bad = json.dumps({k: v for k, v in json.loads(good).items() if k != "num_hidden_layers"}).encode()
    fake = _upload(monkeypatch, bad)
    form.model_config_upload("plan.training", tmp_path)
    assert fake.query_params == {} and len(fake.errors) == 1
    assert fake.errors[0].startswith("model:") and "num_hidden_layers" in fake.errors[0]  # names the setting and the field
