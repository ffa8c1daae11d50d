"""Issue #31's stalled person, the "dropped" way, reproduced in Chromium against Streamlit 1.67 itself (a small app,
not the explorer, so nothing of the explorer's can hide or cause it). With runner.fastReruns (Streamlit's default) a
click while the page's full run is still going starts a new script runner at once; the old run goes on to its end on
its own thread and its fragment storage clear() keeps only the fragments it registered, removing the live view the
click's run registered meanwhile: the browser's timer for the view keeps firing, and the server drops every request
(its fragment is gone). Here the page's run is held after its last element (the explorer's page has its store reads
and log there, a few milliseconds; on a loaded box, longer) so the click always lands in that window. With
fastReruns off the click waits for the page's run, and the view polls."""
import os
import subprocess
import sys
import time

import pytest

from tests.browser.test_app_browser import CHROMIUM, CHROMIUM_ARGS, _require_browser
from tests.browser.streamlit_server import stop

APP = '''
import os, time
import streamlit as st

@st.fragment(run_every=5)
def sidebar_queue():
    st.caption("queue")

sidebar_queue()
if st.button("Run"):
    @st.fragment(run_every=0.3)
    def live_view():
        with open(os.environ["TICKS"], "a") as log:
            log.write(f"{time.time()}\\n")
        st.write("polling")

    live_view()
else:
    st.write("page drawn")
    time.sleep(float(os.environ["TAIL_S"]))  # after the last element: no yield point until the run's end
'''


TAIL_S = 3.0


def _ticks_after_click(tmp_path, fast_reruns: bool) -> int:
    """How many times the live view ticked after the page's held run ended (its last 2.5 s of polling)."""
    from playwright.sync_api import sync_playwright

    from backend.comm.spawn import free_port

    script, ticks = tmp_path / "app.py", tmp_path / f"ticks-{fast_reruns}.txt"
    script.write_text(APP)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(script), "--server.headless", "true",
                               "--server.port", str(port), "--server.address", "127.0.0.1",
                               "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
                               "--runner.fastReruns", str(fast_reruns).lower()],
                              cwd=tmp_path, env={**os.environ, "TICKS": str(ticks), "TAIL_S": str(TAIL_S)},
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.set_default_timeout(60_000)
                for _ in range(100):  # the server's first answer
                    try:
                        page.goto(f"http://127.0.0.1:{port}/")
                        break
                    except Exception:
                        time.sleep(0.3)
                page.get_by_text("page drawn").wait_for()  # the page's run is now held in its tail
                clicked = time.time()
                page.get_by_role("button", name="Run").click()
                page.get_by_text("polling").wait_for()
                time.sleep(6)  # the old run's tail ends after 3 s; then 3 s more of the view's timer (0.3 s)
            finally:
                browser.close()
    finally:
        stop(server)
    times = [float(t) for t in ticks.read_text().split()] if ticks.exists() else []
    late = [t for t in times if t > clicked + TAIL_S + 0.5]  # after the page's held run ended, whenever it began
    print(f"fastReruns {fast_reruns}: {len(times)} ticks of the live view, {len(late)} after the page's run ended")
    return len(late)


@pytest.mark.parametrize("fast_reruns", [True, False])
def test_a_click_during_the_pages_run_leaves_the_live_view_polling_only_without_fast_reruns(tmp_path, fast_reruns):
    _require_browser()
    ticks = _ticks_after_click(tmp_path, fast_reruns)
    if fast_reruns:  # it ticked until the old run's clear(), then never again
        assert ticks == 0, f"{ticks} ticks: the view kept polling (the dropped-fragment race did not happen)"
    else:  # about 8 at 0.3 s
        assert ticks >= 3, f"{ticks} ticks: the view stopped polling"


def test_the_explorer_runs_without_fast_reruns():
    """The explorer's own settings keep the click waiting for the page's run (the race above cannot happen there)."""
    import tomllib

    from tests.conftest import REPO

    settings = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert settings["runner"]["fastReruns"] is False
