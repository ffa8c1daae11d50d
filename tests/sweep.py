"""Shared by the topic tests: every choice/bool setting varied one at a time from the defaults, and a page drawn
from a recorded run."""
from __future__ import annotations


def one_at_a_time(config_cls, skip: tuple[str, ...] = ()) -> list[dict]:
    """{} (the defaults), then one dict per non-default choice of each choice or bool setting."""
    defaults, variants = config_cls().to_dict(), [{}]
    for f in config_cls.fields():
        if f.name in skip:
            continue
        options = f.metadata.get("choices") or ((True, False) if config_cls.field_type(f) is bool else ())
        variants += [{f.name: v} for v in options if v != defaults[f.name]]
    return variants


def render_recorded(page: str, name: str, **settings):
    """Run `name` recorded in the test store, open `page` on it through app.py; returns the AppTest."""
    from backend import experiments
    from backend.store import RunStore
    from tests.test_pages import _app

    exp = experiments.get(name)
    config = exp.make_config(settings)
    store = RunStore()
    run_id = store.create(exp.name, config.to_dict(), "page-test", status="running")
    report = experiments.run_recorded(exp, config, experiments.RunContext(), store, run_id)
    assert report["status"] == "succeeded", report.get("error")
    return _app(page, run=run_id)
