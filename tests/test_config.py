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
