"""bench/render_profile.py's reading of DevTools' sampled profile and its summary of page opens (no browser)."""
from bench import render_profile


def test_js_self_time_sums_each_samples_gap_by_script_and_function():
    """Three nodes sampled; each sample's time is its gap (µs), summed by the script (file name) and function."""
    frame = lambda fn, url: {"functionName": fn, "url": url, "lineNumber": 1}  # noqa: E731
    profile = {"nodes": [{"id": 1, "callFrame": frame("(idle)", "")},
                         {"id": 2, "callFrame": frame("render", "http://h/static/js/react-dom.abc.js")},
                         {"id": 3, "callFrame": frame("embed", "http://h/static/js/embed.def.js")}],
               "samples": [2, 2, 3, 1], "timeDeltas": [100_000, 200_000, 50_000, 1_000_000]}
    got = render_profile.js_self_time(profile)
    assert got["total_s"] == 1.35
    assert got["by_script"] == {"((idle))": 1.0, "react-dom.abc.js": 0.3, "embed.def.js": 0.05}
    assert got["by_function"]["render react-dom.abc.js:1"] == 0.3


def test_summarise_takes_each_figures_median_over_a_pages_opens():
    opens = {"home": [{"chromium_cpu_s": 0.9, "elements": 74}, {"chromium_cpu_s": 0.7, "elements": 74},
                      {"chromium_cpu_s": 2.0, "elements": 74}]}
    assert render_profile.summarise(opens) == {"home": {"chromium_cpu_s": 0.9, "elements": 74, "opens": 3}}
