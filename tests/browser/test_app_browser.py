"""Real Chromium (Debian's package, driven by Playwright) against a real `streamlit run app.py`."""
import contextlib
import json
import os
import shutil

import pytest

from tests.browser.streamlit_server import streamlit_app

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# How long a page may take to load or show an element: generous, since a CI host's CPU may be shared (steal time
# up to 77% in 10-s windows here) while the other test worker runs multi-rank jobs. A working page shows in seconds.
UI_TIMEOUT_MS = 90_000


def new_page(owner, **options):
    """A page of a browser or a browser context, whose loads and actions wait up to UI_TIMEOUT_MS."""
    page = owner.new_page(**options)
    page.set_default_timeout(UI_TIMEOUT_MS)
    return page


def _require_browser():
    missing = not os.path.exists(CHROMIUM)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no browser: chromium at {CHROMIUM} and playwright are required")
        pytest.skip("chromium or playwright not installed")


@contextlib.contextmanager
def streamlit_server(data_dir):
    _require_browser()
    with streamlit_app(data_dir) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with streamlit_server(tmp_path_factory.mktemp("browser-data")) as url:
        yield url


def test_a_deep_link_as_a_fresh_servers_first_request_goes_through_app_py(tmp_path):
    """Streamlit runs a pages/ folder as a v1 app until st.navigation has run once (pages/navigation_guard.py);
    if an upgrade breaks the guard, this first request would show the bare page without the router."""
    from playwright.sync_api import expect, sync_playwright

    with streamlit_server(tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = new_page(browser, viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/pipeline?schedule=gpipe")
        expect(page.get_by_role("heading", name="Pipeline parallel")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(page.get_by_text("Job queue")).to_be_visible()  # app.py's sidebar: the router ran
        expect(page.get_by_role("link", name="Data parallel & ZeRO")).to_be_visible()  # st.navigation's links
        expect(page.get_by_text("Page not found")).to_have_count(0)
        browser.close()


def test_launch_bandwidth_run_see_chart_download_trace(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = new_page(browser, viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        # A deep link carries the settings; the server validates them like any other input.
        page.goto(f"{server}/comm_bandwidth?world_size=2&max_bytes=4096&iters=2&ops=all_reduce,all_gather")
        expect(page.get_by_role("heading", name="Collective bandwidth")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(page.get_by_role("spinbutton", name="world_size")).to_have_value("2")
        expect(page.get_by_text("Job queue")).to_be_visible()  # routed through app.py, not a bare page
        page.get_by_role("button", name="Run").click()
        expect(page.get_by_text("checks against independent references passed")).to_be_visible(timeout=2 * UI_TIMEOUT_MS)
        expect(page.locator("[data-testid='stVegaLiteChart']").first).to_be_visible(timeout=UI_TIMEOUT_MS)
        assert "run=" in page.url
        with page.expect_download(timeout=UI_TIMEOUT_MS) as info:
            page.get_by_role("button", name="Trace (Chrome JSON)").click()
        path = tmp_path / "trace.json"
        info.value.save_as(path)
        trace = json.loads(path.read_text())
        ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert ranks == {0, 1}
        with page.expect_download(timeout=UI_TIMEOUT_MS) as info:  # read from the store when clicked, not per draw
            page.get_by_role("button", name="Result JSON").click()
        info.value.save_as(tmp_path / "result.json")
        assert json.loads((tmp_path / "result.json").read_text())["experiment"] == "comm.bandwidth"
        if os.environ.get("EXPLORER_SCREENSHOT"):
            page.screenshot(path=os.environ["EXPLORER_SCREENSHOT"], full_page=True)
        # The run is shared: the Runs page lists it and opens it by URL.
        run_id = page.url.split("run=")[1].split("&")[0]
        page.goto(f"{server}/runs?run={run_id}")
        expect(page.get_by_text(f"Run {run_id}").first).to_be_visible(timeout=UI_TIMEOUT_MS)
        browser.close()
