"""Sign-in as Jupyter does it, in real Chromium: a server bound beyond localhost asks for its token and a name;
?token= once sets a cookie (a keyed digest, not the token) and leaves the address bar; a browser without it is asked
again. The name is who the runs started from that browser belong to, also on a later visit."""
import time

import pytest

from tests.browser.streamlit_server import streamlit_app
from tests.browser.test_app_browser import CHROMIUM, CHROMIUM_ARGS, UI_TIMEOUT_MS, _require_browser, new_page

TOKEN = "t0k3n-for-this-test-only"


@pytest.fixture(scope="module")
def exposed_data(tmp_path_factory):
    return tmp_path_factory.mktemp("token-data")


@pytest.fixture(scope="module")
def exposed_server(exposed_data):
    _require_browser()
    with streamlit_app(exposed_data, "--server.address", "0.0.0.0", env={"EXPLORER_TOKEN": TOKEN}) as url:
        yield url


def test_token_flow(exposed_server, exposed_data):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        stranger = new_page(browser)
        stranger.goto(f"{exposed_server}/runs")
        expect(stranger.get_by_role("heading", name="Sign in")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(stranger.get_by_text("Job queue")).to_have_count(0)  # nothing of the app without the token
        stranger.goto(f"{exposed_server}/?token=wrong")
        expect(stranger.get_by_text("That token is not this server's.")).to_be_visible(timeout=UI_TIMEOUT_MS)

        context = browser.new_context()
        member = new_page(context)
        member.goto(f"{exposed_server}/?token={TOKEN}")
        member.get_by_label("Your name", exact=True).fill("Ana <b>")  # not an allowed name: said so, with what is allowed
        member.get_by_role("button", name="Sign in").click()
        expect(member.get_by_text("name: 'Ana <b>' is not allowed (allowed: 1 to 40 characters")).to_be_visible(
            timeout=UI_TIMEOUT_MS)
        member.get_by_label("Your name", exact=True).fill("Ana Lima")
        member.get_by_role("button", name="Sign in").click()
        expect(member.get_by_text("Job queue")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(member.get_by_text("Signed in as Ana Lima")).to_be_visible(timeout=UI_TIMEOUT_MS)
        deadline = time.time() + 10
        while "token=" in member.url and time.time() < deadline:
            time.sleep(0.1)
        assert "token=" not in member.url  # out of the address bar and the history
        deadline = time.time() + 10
        while not any(c["name"] == "explorer_auth" for c in context.cookies()) and time.time() < deadline:
            time.sleep(0.1)
        cookie = next(c for c in context.cookies() if c["name"] == "explorer_auth")
        assert TOKEN not in cookie["value"]
        again = new_page(context)  # a later visit: the cookie is enough, and the name comes with it
        again.goto(f"{exposed_server}/runs")
        expect(again.get_by_role("heading", name="Runs")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(again.get_by_text("Signed in as Ana Lima")).to_be_visible(timeout=UI_TIMEOUT_MS)
        again.goto(f"{exposed_server}/number_formats")  # a run from this browser is recorded as Ana's
        again.get_by_role("button", name="Run", exact=True).click()
        from backend.store import RunStore

        deadline = time.time() + 60
        while not (runs := RunStore(exposed_data).list(experiment="numerics.formats")) and time.time() < deadline:
            time.sleep(0.2)
        assert runs and {r.owner for r in runs} == {"Ana Lima"}
        again.goto(f"{exposed_server}/runs")
        expect(again.get_by_text("Ana Lima").first).to_be_visible(timeout=UI_TIMEOUT_MS)

        pasted = new_page(browser)  # or paste the token into the form
        pasted.goto(exposed_server)
        pasted.get_by_label("Your name", exact=True).fill("ben")
        pasted.get_by_label("Token").fill(TOKEN)
        pasted.get_by_role("button", name="Sign in").click()
        expect(pasted.get_by_text("Job queue")).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(pasted.get_by_text("Signed in as ben")).to_be_visible(timeout=UI_TIMEOUT_MS)
        browser.close()
