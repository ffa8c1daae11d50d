"""Every experiment's defaults, and every choice of each choice or bool setting with the rest at defaults, pass
their checks or are refused with one message naming a setting and what it allows (issue #19).

Parametrised from the registry, so a new experiment or a new choice is covered by itself. Each case runs in-process
the way the job leader runs it (distributed experiments spawn their ranks). A case whose checks fail is run once
more: the checks that compare measured timings (the pipeline's replayed bubble, 5 points) can miss by the noise of a
shared 2-core box (5.6 points once in about 30 runs); a defect fails both runs. The experiments whose topic tests
already sweep them with tests/sweep.py's one_at_a_time (asserting more than `passed`) are not run twice; a test below
checks that each of them is still swept there. Neither are the runs the every-page browser walk makes through the
pages (each page's defaults and one choice), while it is on: a test below checks they are real cases of this sweep.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend import experiments
from backend.config import ConfigError
from tests.browser import every_page
from tests.sweep import one_at_a_time

# experiment -> the topic test that sweeps it with one_at_a_time(<its Config class>)
SWEPT_BY_TOPIC_TEST = {
    "decoding.speculative": "test_speculative.py",
    "estimate.training": "test_estimate.py",
    "models.moe_routing": "test_moe.py",
    "numerics.formats": "test_numerics.py",
    "numerics.mixed_precision": "test_numerics.py",
    "rl.bellman": "test_bellman.py",
}

# Settings whose other choices make the run fail on purpose (an injected crash, silent exit or hang): tests/test_jobs.py
# checks that each ends as failed with the faulty rank named and nothing left running.
DELIBERATE_FAILURES = {"comm.selftest": ("fault",)}


def _cases():
    walked = every_page.covered_runs() if every_page.enabled() else set()
    for exp in experiments.all_experiments():
        if exp.name in SWEPT_BY_TOPIC_TEST:
            continue
        for change in one_at_a_time(exp.config_cls, skip=DELIBERATE_FAILURES.get(exp.name, ())):
            label = ",".join(f"{k}={v}" for k, v in change.items()) or "defaults"
            if (exp.name, label) not in walked:  # the browser walk runs these through their pages, checks included
                yield pytest.param(exp.name, change, id=f"{exp.name}[{label}]")


@pytest.mark.parametrize("name, change", list(_cases()))
def test_setting_passes_its_checks_or_is_refused_by_name(name, change):
    exp = experiments.get(name)
    try:
        config = exp.make_config(change)
    except ConfigError as err:
        assert change, f"the defaults of {name} are refused: {err}"
        assert err.field in {f.name for f in exp.config_cls.fields()}, f"the refusal names no setting: {err}"
        assert "allowed" in str(err), f"the refusal does not say what is allowed: {err}"
        return
    result = exp.run(config)
    failed = [f"{c.name}: {c.error} > {c.tolerance}" for c in result.checks if not c.passed]
    if failed:  # a timing check (a replayed bubble) can miss by noise once; a defect misses both times
        result = exp.run(config)
        failed = [f"{c.name}: {c.error} > {c.tolerance} (also on a second run)" for c in result.checks if not c.passed]
    assert result.checks and not failed, failed


@pytest.mark.parametrize("name, test_file", SWEPT_BY_TOPIC_TEST.items())
def test_experiments_left_out_above_are_swept_by_their_topic_test(name, test_file):
    config_cls = experiments.get(name).config_cls.__name__
    source = (Path(__file__).parent / test_file).read_text()
    assert re.search(rf"one_at_a_time\({config_cls}\b", source), f"{test_file} no longer sweeps {name}"


def test_the_browser_walk_runs_cases_of_this_sweep():
    """What the walk covers is named as this sweep names its cases, so nothing drops out of both."""
    every = {(exp.name, ",".join(f"{k}={v}" for k, v in change.items()) or "defaults")
             for exp in experiments.all_experiments() for change in one_at_a_time(exp.config_cls)}
    assert every_page.covered_runs() <= every, every_page.covered_runs() - every
