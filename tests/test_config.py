import dataclasses

import pytest

from backend import experiments
from backend.config import Config, ConfigError, setting


@dataclasses.dataclass
class Demo(Config):
    n: int = setting(4, min=2, max=8)
    rate: float = setting(0.5, min=0.0, max=1.0)
    mode: str = setting("a", choices=("a", "b"))
    flag: bool = setting(False)


def test_strings_parse_to_field_types():
    c = Demo.from_dict({"n": "3", "rate": "0.25", "mode": "b", "flag": "true"})
    assert (c.n, c.rate, c.mode, c.flag) == (3, 0.25, "b", True)


@pytest.mark.parametrize("values, field, fragment", [
    ({"n": "9"}, "n", "2..8"),
    ({"n": "x"}, "n", "not an integer"),
    ({"n": True}, "n", "not an integer"),
    ({"rate": "nan"}, "rate", "out of range"),
    ({"mode": "c"}, "mode", "one of a, b"),
    ({"flag": "maybe"}, "flag", "true or false"),
    ({"nope": "1"}, "nope", "allowed settings: n, rate, mode, flag"),
])
def test_bad_values_name_the_field_and_range(values, field, fragment):
    with pytest.raises(ConfigError) as info:
        Demo.from_dict(values)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@dataclasses.dataclass
class Lists(Config):
    sizes: tuple[int, ...] = setting([1, 8, 64], item_range=(1, 256), length=(1, 4))
    ops: tuple[str, ...] = setting(["a"], choices=("a", "b"))
    values: tuple[float, ...] = setting([0.5, 2.0])


def test_a_list_setting_parses_a_comma_separated_string_or_a_json_list():
    c = Lists.from_dict({"sizes": " 2, 16,,256 ", "ops": "b,a", "values": "inf, -1e-5"})
    assert (c.sizes, c.ops, c.values) == ((2, 16, 256), ("b", "a"), (float("inf"), -1e-5))
    assert Lists.from_dict({"sizes": [4, 32], "values": [3, 0.25]}).to_dict() == {"sizes": (4, 32), "ops": ("a",),
                                                                                  "values": (3.0, 0.25)}
    assert Lists.allowed(Lists.field_of("sizes")) == "a comma-separated list of 1..4 integers, each in 1..256"


@pytest.mark.parametrize("values, field, fragment", [
    ({"sizes": "1,512"}, "sizes", "512 in '1,512' is out of range (allowed: a comma-separated list of 1..4 integers, each in 1..256)"),
    ({"sizes": "0"}, "sizes", "0 in '0' is out of range"),
    ({"sizes": "1,x"}, "sizes", "'x' in '1,x' is not an integer"),
    ({"sizes": [1, 2.5]}, "sizes", "2.5 in '1,2.5' is not an integer"),
    ({"sizes": 8}, "sizes", "8 is not a list"),
    ({"sizes": "1,2,3,4,5"}, "sizes", "5 items in '1,2,3,4,5' (allowed: a comma-separated list of 1..4"),
    ({"sizes": " , "}, "sizes", "0 items"),
    ({"ops": "a,c"}, "ops", "'c' in 'a,c' is out of range (allowed: a comma-separated list of names, each one of a, b)"),
    ({"values": "1,nan"}, "values", "nan in '1.0,nan' is out of range"),
])
def test_a_bad_list_item_is_refused_naming_the_field_the_item_and_the_range(values, field, fragment):
    with pytest.raises(ConfigError) as info:
        Lists.from_dict(values)
    assert info.value.field == field and fragment in str(info.value) and "\n" not in str(info.value)


def test_the_item_rules_are_what_refuses(monkeypatch):
    """Break the per-item range rule and the out-of-range item is accepted: the refusals above come from it."""
    import backend.config

    monkeypatch.setattr(backend.config, "_in_range", lambda value, meta: True)
    assert Lists.from_dict({"sizes": "1,512"}).sizes == (1, 512)


def test_an_old_links_list_still_opens_the_same_settings():
    """Links and stored runs from before list settings carry the comma-separated text ("1,8,64,256"; a stored
    config held the same string): they give the same settings as the list."""
    exp = experiments.get("hardware.decode")
    old = exp.make_config({"batch_sizes": "1,8,64,256"})
    assert old.batch_sizes == (1, 8, 64, 256) == exp.make_config({}).batch_sizes
    assert old.digest(exp.name, "v") == exp.make_config({"batch_sizes": [1, 8, 64, 256]}).digest(exp.name, "v")
    assert experiments.get("comm.bandwidth").make_config({"ops": "all_reduce,all_to_all"}).ops == ("all_reduce", "all_to_all")
    with pytest.raises(ConfigError, match=r"batch_sizes: 300 in '1,300' is out of range \(allowed: .*each in 1..256\)"):
        exp.make_config({"batch_sizes": "1,300"})


def test_python_api_rejects_bad_input():
    with pytest.raises(ConfigError, match="world_size: 99 is out of range"):
        experiments.run("comm.bandwidth", world_size=99)
    with pytest.raises(ConfigError, match="min_bytes"):
        experiments.run("comm.bandwidth", min_bytes=4096, max_bytes=1024)
    with pytest.raises(ConfigError, match="unknown experiment"):
        experiments.get("no.such")


def test_digest_depends_on_settings_and_code():
    a, b = Demo(), Demo(n=3)
    assert a.digest("x", "v1") == Demo().digest("x", "v1")
    assert a.digest("x", "v1") != b.digest("x", "v1")
    assert a.digest("x", "v1") != a.digest("x", "v2")


# --- every experiment's settings, built from strings as a URL or the CLI gives them ------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from backend import limits  # noqa: E402

EXPERIMENTS = experiments.all_experiments()


def _raw_values(f) -> st.SearchStrategy[str]:
    """Strings a user might send for one field: its choices, its bounds, numbers around and past them, junk."""
    m = f.metadata
    options = [st.text(max_size=12), st.sampled_from(["", " ", "nan", "inf", "-1", "1e309", "true", "0x10", "1,2,3"])]
    if m.get("choices"):
        options.append(st.sampled_from([str(c) for c in m["choices"]]))
    numbers = [b for b in (m.get("min"), m.get("max")) if b is not None]
    if numbers:
        low, high = min(numbers), max(numbers)
        options.append(st.sampled_from([str(b) for b in numbers]))
        options.append(st.integers(int(low) - 2, int(high) + 2).map(str))
        options.append(st.floats(float(low), float(high)).map(repr))
    if f.type in (bool, "bool"):
        options.append(st.sampled_from(["true", "false", "1", "0", "yes"]))
    return st.one_of(options)


@st.composite
def raw_settings(draw, exp):
    fields = exp.config_cls.fields()
    chosen = draw(st.lists(st.sampled_from(fields), unique_by=lambda f: f.name, max_size=len(fields)))
    return {f.name: draw(_raw_values(f)) for f in chosen}


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=[e.name for e in EXPERIMENTS])
def test_any_strings_give_a_named_error_or_a_run_within_budget(exp):
    names = {f.name for f in exp.config_cls.fields()}

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(raw_settings(exp))
    def check(values):
        try:
            config = exp.make_config(values)
        except ConfigError as err:  # anything else is a traceback a user would see
            assert err.field in names, f"{err} names no setting of {exp.name}"
            assert "\n" not in str(err)
            return
        est = config.estimate()
        assert est.memory_bytes <= limits.memory_budget() and est.seconds <= limits.time_budget()

    check()


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=[e.name for e in EXPERIMENTS])
def test_defaults_fit_and_the_maxima_are_refused_with_a_value_that_fits(exp):
    exp.make_config({})  # defaults are accepted
    maxima = {f.name: f.metadata["max"] for f in exp.config_cls.fields() if f.metadata.get("max") is not None}
    try:
        config = exp.make_config(maxima)
    except ConfigError as err:
        assert err.field in {f.name for f in exp.config_cls.fields()}
        return
    est = config.estimate()
    assert est.memory_bytes <= limits.memory_budget() and est.seconds <= limits.time_budget()


def test_refusal_names_the_driving_setting_and_the_largest_value_that_fits():
    exp = experiments.get("comm.collectives")
    with pytest.raises(ConfigError) as info:
        exp.make_config({"numel": str(16 << 20), "iters": "10", "world_size": "6"})
    assert info.value.field == "numel" and "EXPLORER_RUN_MEMORY_GIB" in str(info.value)
    best = int(str(info.value).split("numel = ")[1].rstrip(")"))
    exp.make_config({"numel": str(best), "iters": "10", "world_size": "6"})  # the value it names fits
    with pytest.raises(ConfigError, match="numel"):
        exp.make_config({"numel": str(best + 1), "iters": "10", "world_size": "6"})  # and is the largest that does
