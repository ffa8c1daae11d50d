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


def open_page(page: str | None = None, default_timeout: float = 60, **params):
    """The app (app.py, so the page runs inside its navigation) opened on `page` with these URL parameters, run once."""
    from streamlit.testing.v1 import AppTest

    from tests.conftest import REPO

    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=default_timeout)
    if page:
        at.switch_page(page)
    for k, v in params.items():
        at.query_params[k] = v
    return at.run()


def recorded(name: str, settings: dict, timeout_s: float = 120.0, stored_as: str | None = None) -> str:
    """Run `name` in this process, recorded in the test store as a server records it (under `stored_as`, an old name,
    if given); its id. Fails the test unless the run succeeded."""
    from backend import experiments, record
    from backend.store import RunStore

    exp = experiments.get(name)
    config = exp.make_config(settings)
    store = RunStore()
    run_id = store.create(stored_as or exp.name, config.to_dict(), f"test-{name}", status="running")
    report = record.run_recorded(exp, config, experiments.RunContext(timeout_s=timeout_s), store, run_id)
    assert report["status"] == "succeeded", report.get("error")
    return run_id


def render_recorded(page: str, name: str, **settings):
    """Run `name` recorded in the test store, open `page` on it through app.py, check it drew without an exception
    and with every check passed; returns the AppTest."""
    run_id = recorded(name, settings)
    at = open_page(page, run=run_id)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)
    return at
