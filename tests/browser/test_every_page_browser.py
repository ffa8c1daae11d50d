"""Every page of the catalog in real Chromium, as a first-time user meets it, on one server, one page after another.

For each page: it renders with no exception; it opens on its default settings' run, whose checks all pass, and pressing
Run at the defaults shows that same run;
every chart is drawn (vega-embed's SVG or canvas, with marks in it); no metric value or label is cut off at a
1280-px-wide window; a link to the run (?run=ID) reproduces it (same header, same checks, same metric values); and a
screenshot of the whole page goes to tests/browser/screenshots/ (git-ignored), with each default run's time in
timings.json beside them (from opening the page to the run's result, what a first-time user waits; the run starts
on the visit). A page's default run is not skipped when it is slow: its time is recorded. Then one
non-default choice per page (every_page.NON_DEFAULT) is made through the form and run.

Part of `make test` (about 16 minutes on a quiet 2-core box); EXPLORER_BROWSER_EVERY_PAGE=0 leaves it out. The runs it
makes are left out of tests/test_every_setting.py while it is on (every_page.covered_runs).
"""
import contextlib
import json
import re
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.browser import every_page
from tests.browser.every_page import NON_DEFAULT, ORDER
from tests.browser.streamlit_server import streamlit_app
from tests.browser.test_app_browser import CHROMIUM, CHROMIUM_ARGS, UI_TIMEOUT_MS, _require_browser, new_page

pytestmark = pytest.mark.skipif(not every_page.enabled(), reason="EXPLORER_BROWSER_EVERY_PAGE=0")

SCREENSHOTS = Path(__file__).parent / "screenshots"
VIEWPORT = {"width": 1280, "height": 900}  # the default window: metrics must fit at this width
# The server's job time limit for this walk. Its default (120 s) is the budget each page's defaults are estimated
# against (tests/test_config.py); here the pages are under test, not the machine's speed: on a CI host whose CPU
# is shared (steal time up to 77% in 10-s windows) beside the other test worker, a 15-s run has taken over 120 s.
JOB_TIMEOUT_S = 300
RUN_TIMEOUT_MS = (JOB_TIMEOUT_S + 120) * 1000  # the limit plus the queue and the page's redraw, with margin

# Every metric's label, value and delta: is any of its parts cut (content wider than its box)? Streamlit 1.67
# truncates each with `overflow: hidden; text-overflow: ellipsis` on the Markdown container inside it.
METRICS_JS = """() => [...document.querySelectorAll('[data-testid=stMain] [data-testid=stMetric]')].map(m => {
  const cut = el => !!el && [el, ...el.querySelectorAll('*')].some(e => e.scrollWidth > e.clientWidth + 1
                                                                     && getComputedStyle(e).overflowX !== 'visible');
  const label = m.querySelector('[data-testid=stMetricLabel]'), value = m.querySelector('[data-testid=stMetricValue]');
  const delta = m.querySelector('[data-testid=stMetricDelta]');
  return {label: label ? label.innerText.trim() : '', value: value ? value.innerText.trim() : '',
          delta: delta ? delta.innerText.trim() : '', label_cut: cut(label), value_cut: cut(value), delta_cut: cut(delta)};
})"""
# Every Altair chart: drawn when vega-embed has put an SVG or a canvas with a size in it, and the SVG has marks.
CHARTS_JS = """() => [...document.querySelectorAll('[data-testid=stMain] [data-testid=stVegaLiteChart]')].map(c => {
  const svg = c.querySelector('svg.marks'), canvas = c.querySelector('canvas');
  const drawn = svg ? svg.querySelectorAll('.role-mark').length > 0 && svg.getBoundingClientRect().width > 0
                    : !!canvas && canvas.width > 0 && canvas.height > 0;
  return {drawn, hidden: c.getBoundingClientRect().width === 0};
})"""

# Every table (a glide grid: its cells are drawn on a canvas, its a11y table holds the headers and visible cells): are
# its columns cut at the right (the scroller wider inside than its box), is a header a snake_case key, is a visible
# cell empty (how the grid draws a missing value, "None")?
TABLES_JS = """() => [...document.querySelectorAll('[data-testid=stMain] [data-testid=stDataFrame]')].map(d => {
  const s = d.querySelector('.dvn-scroller');
  const heads = [...d.querySelectorAll('[role=columnheader]')].map(h => h.innerText.trim()).filter(h => h);
  const cells = [...d.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim());
  return {hidden: d.getBoundingClientRect().width === 0, cut: !!s && s.scrollWidth > s.clientWidth + 1,
          width: s ? s.clientWidth : 0, inner: s ? s.scrollWidth : 0, heads,
          raw: cells.filter(c => c === '' || c === 'None' || c === 'nan' || c === 'NaN').length};
})"""
# Every chart's plot areas, in the SVG Vega draws (each view: the chart, or each cell of a concatenation): the share of
# the area's width and of its height that the marks of that view (not its axes, legends or titles) cover. Data that
# fills less than a third of an axis hides its shape (a zero baseline far from the data, a log axis niced out to
# decades the data never reach, a domain fixed too wide). Each axis's title and tick labels come with it.
AXES_JS = """() => [...document.querySelectorAll('[data-testid=stMain] [data-testid=stVegaLiteChart]')].map(c => {
  const svg = c.querySelector('svg.marks');
  if (!svg || c.getBoundingClientRect().width === 0) return {hidden: true, views: []};
  const scopeOf = e => e.parentElement.closest('.role-scope, .role-frame');
  const outside = e => !!e.closest('.role-axis, .role-legend, .role-title');
  const title = svg.querySelector('.role-title text');
  const owners = new Set([...svg.querySelectorAll('.role-axis')].map(scopeOf));  // a view: a scope with axes of its own
  const viewOf = e => { let s = scopeOf(e); while (s && !owners.has(s)) s = scopeOf(s); return s; };
  const views = [...owners].map(scope => {
    const mine = sel => [...scope.querySelectorAll(sel)].filter(e => scopeOf(e) === scope);
    const bg = mine('path.background').find(e => !outside(e));
    const items = [...scope.querySelectorAll('.role-mark > *')].filter(e => viewOf(e.parentElement) === scope && !outside(e) &&
        !e.classList.contains('background') && !e.closest('.role-legend')).map(e => e.getBoundingClientRect()).filter(r => r.width + r.height > 0);
    if (!bg || !items.length) return null;
    const area = bg.getBoundingClientRect();
    if (area.width < 20 || area.height < 20) return null;
    const fill = (lo, hi, a, b) => Math.max(0, Math.min(hi, b) - Math.max(lo, a)) / (hi - lo);
    const axes = mine('.role-axis').map(axis => {
      const t = axis.querySelector('.role-axis-title text'), labels = [...axis.querySelectorAll('.role-axis-label text')];
      if (!labels.length) return null;
      const r = [labels[0].getBoundingClientRect(), labels[labels.length - 1].getBoundingClientRect()];
      const horizontal = labels.length < 2 ? r[0].top >= area.bottom - 1 : Math.abs(r[1].x - r[0].x) > Math.abs(r[1].y - r[0].y);
      return {title: t ? t.textContent : '', horizontal, labels: labels.map(l => l.textContent)};
    }).filter(a => a);
    return {axes, x: fill(area.left, area.right, Math.min(...items.map(r => r.left)), Math.max(...items.map(r => r.right))),
            y: fill(area.top, area.bottom, Math.min(...items.map(r => r.top)), Math.max(...items.map(r => r.bottom)))};
  }).filter(v => v);
  return {hidden: false, title: title ? title.textContent : '', views};
})"""


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """One server and one browser for every page, as a user would walk through them."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    for old in [SCREENSHOTS / "failures.txt", *SCREENSHOTS.glob("*-FAILED.png")]:
        old.unlink(missing_ok=True)
    timings = {}
    # as a user meets the pages: each opens on its defaults' run, started by the first visit (the other tests turn it off)
    with streamlit_app(tmp_path_factory.mktemp("every-page-data"), env={"EXPLORER_OPEN_ON_DEFAULT_RUN": "1", "EXPLORER_JOB_TIMEOUT_S": str(JOB_TIMEOUT_S)}) as url, \
            sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield url, browser, timings
        browser.close()


@contextlib.contextmanager
def _page(browser, url: str, name: str):
    """A page at `url`, opened as a user does, and closed afterwards whatever happens: a page left open keeps its
    sidebar polling the server every few seconds, and a failure must not slow every page after it. On a failure, the
    page as it was (name-FAILED.png) and the message (failures.txt) go beside the screenshots as they happen: a long
    walk over every page is read there, not only in pytest's summary at the end."""
    from playwright.sync_api import expect

    page = new_page(browser, viewport=VIEWPORT)
    try:
        page.goto(url)
        expect(page.locator("[data-testid=stMain] h1").first).to_be_visible(timeout=UI_TIMEOUT_MS)
        yield page
    except BaseException as err:
        with contextlib.suppress(Exception):
            page.screenshot(path=SCREENSHOTS / f"{name}-FAILED.png")
        with open(SCREENSHOTS / "failures.txt", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {name}: {type(err).__name__}: {str(err)[:3000]}\n")
        raise
    finally:
        page.close()


def _settled(page, timeout_s: float = 90) -> None:
    """Wait until the page's script run is over and drawn: stApp carries the script's state, the browser draws the
    elements after it (a second later on a loaded machine), and the sidebar's queue refreshes every few seconds,
    so the state must read notRunning with the same elements on the page for 1.5 s."""
    deadline, quiet, last = time.time() + timeout_s, 0, None
    while quiet < 5 and time.time() < deadline:
        page.wait_for_timeout(300)
        state = page.locator("[data-testid=stApp]").get_attribute("data-test-script-state")
        shown = page.evaluate("() => document.querySelectorAll('[data-testid=stMain] [data-testid=stElementContainer]').length")
        quiet = quiet + 1 if state == "notRunning" and shown == last else 0
        last = shown
    assert quiet >= 5, f"the page script still runs after {timeout_s:.0f} s"


def _no_exception(page, where: str) -> None:
    exceptions = page.locator("[data-testid=stException]")
    assert exceptions.count() == 0, f"{where}: {exceptions.first.inner_text()[:2000]}"


def _finished_run(page, run_id: str | None = None, retries: int = 1) -> str:
    """Wait for the run shown on the page (or the run `run_id`) to reach a final state; its id. An error alert gone
    before it could be read (a rerun redrawing the page) is not a refusal: the wait goes on, once, for the run the
    page's URL names then."""
    from playwright.sync_api import expect

    which = re.escape(run_id) if run_id else r"\w{12}"
    final = page.locator("[data-testid=stHeading]").filter(has_text=re.compile(rf"Run {which} · .* · (succeeded|failed|cancelled)"))
    refused = page.locator("[data-testid=stAlertContentError]")  # settings refused: no run at all
    expect(final.or_(refused).first).to_be_visible(timeout=RUN_TIMEOUT_MS)
    if not final.count():
        texts = [t for t in refused.all_inner_texts() if t.strip()]
        if texts or not retries:
            pytest.fail(f"the settings were refused: {' | '.join(texts)}")
        shown = parse_qs(urlparse(page.url).query).get("run", [run_id])[0]
        return _finished_run(page, shown, retries - 1)
    header = final.first.inner_text()
    run_id = re.search(r"Run (\w{12})", header).group(1)
    if "succeeded" not in header:
        errors = " | ".join(page.locator("[data-testid=stAlertContentError]").all_inner_texts())
        pytest.fail(f"run {run_id} did not succeed: {header} {errors}")
    return run_id


def _checks_passed(page, run_id: str) -> None:
    from playwright.sync_api import expect

    verdict = page.get_by_text(re.compile(r"checks? against independent references (passed|failed)"))
    expect(verdict.first).to_be_visible(timeout=60_000)
    text = verdict.first.inner_text()
    assert "passed" in text, f"run {run_id}: {text}"


def _charts_drawn(page, where: str) -> int:
    """Every visible chart drawn (charts in a closed tab or expander have no width and are not judged)."""
    deadline = time.time() + 30
    while True:
        charts = [c for c in page.evaluate(CHARTS_JS) if not c["hidden"]]
        if all(c["drawn"] for c in charts) or time.time() > deadline:
            break
        page.wait_for_timeout(500)
    undrawn = sum(not c["drawn"] for c in charts)
    assert undrawn == 0, f"{where}: {undrawn} of {len(charts)} charts not drawn"
    return len(charts)


def _metrics(page, where: str) -> list[dict]:
    metrics = page.evaluate(METRICS_JS)
    cut = [f"{m['label']!r} = {m['value']!r} ({', '.join(part for part in ('label', 'value', 'delta') if m[part + '_cut'])} cut)"
           for m in metrics if m["label_cut"] or m["value_cut"] or m["delta_cut"]]
    assert not cut, f"{where}: metrics cut off at {VIEWPORT['width']} px: {'; '.join(cut)}"
    return metrics


SNAKE_CASE = re.compile(r"[a-z0-9]_[a-z0-9]")
WHOLE_NUMBER_AXIS = re.compile(r"^(\w+ )?(step|rank|iteration|epoch|micro-?batch|layer)s?( \(|$)|\(micro-?batches\)$")
FRACTION = re.compile(r"-?\d+\.\d+")


def readable_problems(tables: list[dict], charts: list[dict]) -> list[str]:
    """What a reader would trip on, from TABLES_JS and AXES_JS: a table cut at the right, a snake_case header, a raw
    missing value; a chart whose marks fill less than a third of an axis; fractions on an axis of whole things."""
    found = []
    for i, t in enumerate(x for x in tables if not x["hidden"]):
        name = f"table {i + 1} ({', '.join(t['heads'][:3])}...)"
        if t["cut"]:
            found.append(f"{name}: columns cut at the right ({t['inner']} px of columns in {t['width']} px)")
        snake = [h for h in t["heads"] if SNAKE_CASE.search(h)]
        if snake:
            found.append(f"{name}: raw column names {snake}")
        if t["raw"]:
            found.append(f"{name}: {t['raw']} empty or None/nan cells")
    for i, c in enumerate(x for x in charts if not x["hidden"]):
        for v in c["views"]:
            titles = {a["horizontal"]: a["title"] for a in v["axes"]}
            name = f"chart {i + 1}{' ' + repr(c['title']) if c['title'] else ''}"
            for horizontal, share in ((True, v["x"]), (False, v["y"])):
                if share < 1 / 3:
                    found.append(f"{name}: the data fills {share:.0%} of its {'x' if horizontal else 'y'} axis "
                                 f"{titles.get(horizontal, '')!r}")
            for a in v["axes"]:
                if WHOLE_NUMBER_AXIS.match(a["title"]) and any(FRACTION.fullmatch(label.replace(",", "")) for label in a["labels"]):
                    found.append(f"{name}: fractional ticks on {a['title']!r}: {a['labels'][:6]}")
    return found


def _readable(page, where: str) -> None:
    """No table cut or raw, no chart axis mostly empty (see readable_problems), at the 1280-px window."""
    page.wait_for_timeout(1000)  # charts drawn again after a change of the window's size
    problems = readable_problems(page.evaluate(TABLES_JS), page.evaluate(AXES_JS))
    assert not problems, f"{where}: " + "; ".join(problems)

def _screenshot(page, name: str, restore: bool = True) -> None:
    """The whole page: Streamlit scrolls its main block, not the document, so the window is made as tall as it
    (and, with restore, set back: every chart is drawn again at each size)."""
    height = page.evaluate("() => document.querySelector('[data-testid=stMain]').scrollHeight")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": min(max(height, VIEWPORT["height"]), 20_000)})
    page.wait_for_timeout(500)
    page.screenshot(path=SCREENSHOTS / f"{name}.png")
    if restore:
        page.set_viewport_size(VIEWPORT)


def _timed(timings: dict, what: str, run_id: str, started: float) -> None:
    """Seconds from pressing Run to the run's final header, written as they come (timings.json)."""
    timings[what] = {"run": run_id, "seconds_to_result": round(time.time() - started, 1)}
    (SCREENSHOTS / "timings.json").write_text(json.dumps(timings, indent=1))


@pytest.mark.parametrize("topic", ORDER, ids=[t.url_path for t in ORDER])
def test_page(app, topic):
    from playwright.sync_api import expect

    url, browser, timings = app
    opened = time.time()
    with _page(browser, f"{url}/{topic.url_path}", topic.url_path) as page:
        run_id, charts, metrics = _default_run(page, topic, timings, opened)
    if run_id is None:
        return
    # A link to the run reproduces it: the same run, checks, metrics and charts, from the URL alone.
    with _page(browser, f"{url}/{topic.url_path}?run={run_id}", f"{topic.url_path}-linked") as linked:
        expect(linked.locator("[data-testid=stHeading]").filter(has_text=f"Run {run_id}").first).to_be_visible(timeout=60_000)
        _checks_passed(linked, run_id)
        _settled(linked)
        _no_exception(linked, f"{topic.title}, linked run {run_id}")
        # The same charts and metric values; on a loaded machine the browser may still be drawing, so wait for them.
        shown = [(m["label"], m["value"], m["delta"]) for m in metrics]
        deadline = time.time() + 60
        while time.time() < deadline and (sum(not c["hidden"] for c in linked.evaluate(CHARTS_JS)) < charts or
                                          [(m["label"], m["value"], m["delta"]) for m in linked.evaluate(METRICS_JS)] != shown):
            linked.wait_for_timeout(500)
        assert _charts_drawn(linked, f"{topic.title}, linked run {run_id}") == charts
        assert [(m["label"], m["value"], m["delta"]) for m in _metrics(linked, f"linked run {run_id}")] == shown


def _default_run(page, topic, timings: dict, opened: float) -> tuple[str | None, int, list[dict]]:
    """The page as it opens, on its defaults' run (started by the visit): the run's id, its charts and metrics (None
    for a page that runs nothing). Pressing Run at the defaults then shows the same run (found by its digest)."""
    if not topic.experiments:
        _settled(page)
        _no_exception(page, topic.title)
        _charts_drawn(page, topic.title)
        _metrics(page, topic.title)
        _screenshot(page, topic.url_path)
        _readable(page, topic.title)
        return None, 0, []
    run_id = _finished_run(page)  # nothing pressed: a first visit starts the default run
    _timed(timings, topic.url_path, run_id, opened)
    _checks_passed(page, run_id)
    _settled(page)
    page.locator("[data-testid=stFormSubmitButton] button").first.click()
    _settled(page)
    linked = parse_qs(urlparse(page.url).query).get("run")
    assert linked == [run_id] and _finished_run(page) == run_id, f"Run at the defaults gave run {linked}, not {run_id}"
    _checks_passed(page, run_id)
    _no_exception(page, f"{topic.title}, run {run_id}")
    charts = _charts_drawn(page, f"{topic.title}, run {run_id}")
    metrics = _metrics(page, f"{topic.title}, run {run_id}")
    _screenshot(page, topic.url_path)
    _readable(page, f"{topic.title}, run {run_id}")
    return run_id, charts, metrics


def _choose(page, field: str, value) -> None:
    """Set one setting of the form as a user does: open its select box and pick, or tick its box."""
    from playwright.sync_api import expect

    if isinstance(value, bool):
        box = page.locator("[data-testid=stCheckbox]").filter(has_text=field).first
        if box.locator("input").is_checked() != value:
            box.locator("label").first.click()
        expect(box.locator("input")).to_be_checked(checked=value)
        return
    select = page.locator("[data-testid=stSelectbox]").filter(has=page.get_by_role("combobox", name=field, exact=True))
    for attempt in range(3):  # a rerun of the page (a live run's view refreshing) closes an open list
        select.get_by_role("button", name="Open").click()
        try:
            page.get_by_role("option", name=str(value), exact=True).click(timeout=10_000)
            break
        except Exception:
            if attempt == 2:
                raise
            _settled(page)
    expect(select.get_by_role("combobox")).to_have_value(str(value))


@pytest.mark.timeout(600)  # the defaults' run drawn, a choice, a second run: on 2 cores beside the rest of the suite
@pytest.mark.parametrize("url_path", list(NON_DEFAULT))
def test_a_non_default_choice_runs(app, url_path):
    url, browser, timings = app
    field, value = NON_DEFAULT[url_path]
    with _page(browser, f"{url}/{url_path}", f"{url_path}-{field}") as page:
        _non_default_run(page, url_path, field, value, timings)


def _non_default_run(page, url_path: str, field: str, value, timings: dict) -> None:
    # The page opens on its defaults' run, but its title is drawn before the script puts that run in the URL (half the
    # opens on a quiet box): read too early, no run was "shown", the defaults' run then in the URL passed for the new
    # one, and the walk waited for that run's heading after the Run had redrawn the page (issue #31's flake).
    page.wait_for_url(lambda u: "run" in parse_qs(urlparse(u).query), timeout=60_000)
    shown = parse_qs(urlparse(page.url).query)["run"]
    if shown:  # a person changes a setting after the defaults' run has drawn, not while its live view refreshes
        done = page.locator("[data-testid=stHeading]").filter(
            has_text=re.compile(rf"Run {re.escape(shown[0])} · .* · (succeeded|failed|cancelled)"))
        try:  # at most a minute: past it, _choose's retries cover a list closed by a refresh
            done.first.wait_for(state="visible", timeout=60_000)
        except Exception:
            pass
    _settled(page)
    _choose(page, field, value)
    started = time.time()
    page.locator("[data-testid=stFormSubmitButton] button").first.click()
    # the new run's id reaches the URL when it is submitted; until then the defaults' run is still on the page
    page.wait_for_url(lambda u: names_new_run(u, shown, field, value), timeout=60_000)
    run_id = _finished_run(page, parse_qs(urlparse(page.url).query)["run"][0])
    _timed(timings, f"{url_path} ({field}={value})", run_id, started)
    _checks_passed(page, run_id)
    _settled(page)
    _no_exception(page, f"{url_path} with {field}={value}, run {run_id}")
    assert parse_qs(urlparse(page.url).query)[field] == [str(value)]  # the run's link carries the choice
    _charts_drawn(page, f"{url_path} with {field}={value}")
    _metrics(page, f"{url_path} with {field}={value}")
    _readable(page, f"{url_path} with {field}={value}")


def names_new_run(url: str, shown: list[str], field: str, value) -> bool:
    """Whether `url` is the page after a Run with `field` = `value`: it names a run other than the one shown before
    (`shown`, the URL's run list) and carries the choice."""
    query = parse_qs(urlparse(url).query)
    return query.get("run", shown) != shown and query.get(field) == [str(value)]


def test_names_new_run_takes_only_the_run_a_choice_started():
    """The walk's wait for the run its choice started: the defaults' run still in the URL is not it (nor a URL
    without the choice); and reading "shown" before the page put the defaults' run in its URL (None, the flake's
    rule) took the defaults' run for the new one."""
    before = "http://h/training_estimates?run=aaaaaaaaaaaa"
    after = "http://h/training_estimates?device=H100+%28SXM%29&run=bbbbbbbbbbbb"
    assert not names_new_run(before, ["aaaaaaaaaaaa"], "device", "H100 (SXM)")
    assert not names_new_run("http://h/training_estimates?run=bbbbbbbbbbbb", ["aaaaaaaaaaaa"], "device", "H100 (SXM)")
    assert names_new_run(after, ["aaaaaaaaaaaa"], "device", "H100 (SXM)")
    stale_rule = lambda u, shown: "run" in parse_qs(urlparse(u).query) and parse_qs(urlparse(u).query)["run"] != shown  # noqa: E731
    assert stale_rule(before, None)  # the old wait, with "shown" read too early, took the defaults' run


def test_readable_problems_finds_each_defect_and_passes_a_clean_page():
    """The walk's reading of a page (no browser needed): each defect of issue #31's class is reported, a clean page is
    not. Measured shapes as TABLES_JS and AXES_JS return them."""
    table = {"hidden": False, "cut": False, "width": 800, "inner": 800, "heads": ["level", "capacity (B)"], "raw": 0}
    view = {"axes": [{"title": "step", "horizontal": True, "labels": ["0", "1", "2"]},
                     {"title": "loss", "horizontal": False, "labels": ["1.0", "1.5"]}], "x": 0.95, "y": 0.8}
    chart = {"hidden": False, "title": "", "views": [view]}
    assert readable_problems([table], [chart]) == []
    broken = [
        ([{**table, "cut": True, "inner": 1395}], [chart], "columns cut"),
        ([{**table, "heads": ["level", "capacity_bytes"]}], [chart], "raw column names"),
        ([{**table, "raw": 2}], [chart], "None/nan"),
        ([table], [{**chart, "views": [{**view, "x": 0.16}]}], "fills 16% of its x axis 'step'"),
        ([table], [{**chart, "views": [{**view, "axes": [{**view["axes"][0], "labels": ["0.0", "0.5", "1.0"]}]}]}], "fractional ticks"),
    ]
    for tables, charts, expected in broken:
        found = readable_problems(tables, charts)
        assert len(found) == 1 and expected in found[0], (expected, found)


def test_a_config_json_upload_runs_and_a_bad_one_is_refused_naming_the_field(app):
    """The planner's uploader as a user meets it: a config.json (Llama 2 7B's shape under another name) is accepted,
    stored under its hash and run; one without num_hidden_layers is refused with the missing field named."""
    from playwright.sync_api import expect

    from backend.plan import models

    url, browser, timings = app
    good = json.loads((models.CONFIG_DIR / "llama-2-7b.json").read_text())
    with _page(browser, f"{url}/plan_training", "plan_training-upload") as page:
        shown = _finished_run(page)
        _settled(page)
        uploader = page.locator("[data-testid=stFileUploader] input[type=file]").first
        uploader.set_input_files(files=[{"name": "config.json", "mimeType": "application/json",
                                         "buffer": json.dumps(good).encode()}])
        page.wait_for_url(lambda u: len(parse_qs(urlparse(u).query).get("model", [""])[0]) == 64, timeout=60_000)
        digest = parse_qs(urlparse(page.url).query)["model"][0]
        expect(page.get_by_text(f"use model {digest[:12]}", exact=False).first).to_be_visible(timeout=UI_TIMEOUT_MS)
        _settled(page)
        started = time.time()
        page.locator("[data-testid=stFormSubmitButton] button").first.click()
        page.wait_for_url(lambda u: parse_qs(urlparse(u).query).get("run", [shown])[0] != shown, timeout=60_000)
        run_id = _finished_run(page, parse_qs(urlparse(page.url).query)["run"][0])
        _timed(timings, "plan_training (uploaded config.json)", run_id, started)
        _checks_passed(page, run_id)
        assert parse_qs(urlparse(page.url).query)["model"] == [digest]
        _settled(page)
        bad = {k: v for k, v in good.items() if k != "num_hidden_layers"}
        uploader.set_input_files(files=[{"name": "config.json", "mimeType": "application/json", "buffer": json.dumps(bad).encode()}])
        refusal = page.locator("[data-testid=stAlertContentError]").filter(has_text="lacks 'num_hidden_layers'")
        expect(refusal.first).to_be_visible(timeout=UI_TIMEOUT_MS)
        assert refusal.first.inner_text().startswith("model: config.json lacks 'num_hidden_layers'")
