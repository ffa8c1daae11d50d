"""Shared by the topic tests: every choice/bool setting varied one at a time from the defaults, a bad setting
refused by name, and a page drawn from a recorded run."""
from __future__ import annotations

import pytest

from backend.config import ConfigError


def one_at_a_time(config_cls, skip: tuple[str, ...] = ()) -> list[dict]:
    """{} (the defaults), then one dict per non-default choice of each choice or bool setting."""
    defaults, variants = config_cls().to_dict(), [{}]
    for f in config_cls.fields():
        if f.name in skip:
            continue
        options = f.metadata.get("choices") or ((True, False) if config_cls.field_type(f) is bool else ())
        variants += [{f.name: v} for v in options if v != defaults[f.name]]
    return variants


def assert_refused(config_cls, values: dict, field: str) -> None:
    """The settings are refused with one message naming `field` and what it allows."""
    with pytest.raises(ConfigError) as info:
        config_cls.from_dict(values)
    assert info.value.field == field and "allowed" in str(info.value)


def render_recorded(page: str, name: str, **settings):
    """Run `name` recorded in the test store, open `page` on it through app.py, check it drew without an exception
    and with every check passed; returns the AppTest."""
    from backend import experiments, record
    from backend.store import RunStore
    from tests.test_pages import _app

    exp = experiments.get(name)
    config = exp.make_config(settings)
    store = RunStore()
    run_id = store.create(exp.name, config.to_dict(), "page-test", status="running")
    report = record.run_recorded(exp, config, experiments.RunContext(), store, run_id)
    assert report["status"] == "succeeded", report.get("error")
    at = _app(page, run=run_id)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)
    return at
