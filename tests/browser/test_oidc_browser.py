"""Streamlit's own OIDC sign-in (st.login) in real Chromium, against a minimal OpenID provider served on loopback by
this test (tests/browser/oidc_provider.py): two people sign in with their emails, a run is recorded under its
owner's email, and only that owner can cancel it (the other is told whose run it is). The server runs no job
(EXPLORER_MAX_JOBS=0), so the run stays queued while they try."""
import time

import pytest

from backend.store import RunStore
from tests.browser.oidc_provider import CLIENT_ID, CLIENT_SECRET, Provider
from tests.browser.streamlit_server import streamlit_app
from tests.browser.test_app_browser import CHROMIUM, CHROMIUM_ARGS, UI_TIMEOUT_MS, _require_browser, new_page


@pytest.fixture(scope="module")
def oidc_server(tmp_path_factory):
    _require_browser()
    data, folder = tmp_path_factory.mktemp("oidc-data"), tmp_path_factory.mktemp("oidc-secrets")
    with Provider() as provider:
        secrets = folder / "secrets.toml"
        secrets.write_text(f'[auth]\nredirect_uri = "http://127.0.0.1:{{port}}/oauth2callback"\n'
                           f'cookie_secret = "a-cookie-secret-for-this-test-only-0123456789"\n'
                           f'client_id = "{CLIENT_ID}"\nclient_secret = "{CLIENT_SECRET}"\n'
                           f'server_metadata_url = "{provider.metadata_url}"\n')
        with streamlit_app(data, "--secrets.files", str(secrets),
                           env={"EXPLORER_MAX_JOBS": "0", "EXPLORER_ADMINS": "root@example.org"}) as url:
            yield url, data


def _sign_in(browser, url: str, email: str):
    context = browser.new_context()
    page = new_page(context)
    page.goto(url)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_label("Email").fill(email)  # the provider's page
    page.get_by_role("button", name="Continue").click()
    from playwright.sync_api import expect

    expect(page.get_by_text(f"Signed in as {email}")).to_be_visible(timeout=UI_TIMEOUT_MS)
    return page


def test_st_login_records_the_owner_and_only_the_owner_cancels(oidc_server):
    from playwright.sync_api import expect, sync_playwright

    url, data = oidc_server
    store = RunStore(data)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            stranger = new_page(browser)
            stranger.goto(f"{url}/runs")
            expect(stranger.get_by_role("heading", name="Sign in")).to_be_visible(timeout=UI_TIMEOUT_MS)
            expect(stranger.get_by_text("Job queue")).to_have_count(0)

            ana = _sign_in(browser, url, "ana@example.org")
            ana.goto(f"{url}/number_formats?seed=4242")
            ana.get_by_role("button", name="Run", exact=True).click()
            expect(ana.get_by_text("Queued: position 1")).to_be_visible(timeout=UI_TIMEOUT_MS)
            deadline = time.time() + 30
            while not (runs := store.list(experiment="numerics.formats")) and time.time() < deadline:
                time.sleep(0.2)
            (run,) = runs
            assert run.owner == "ana@example.org" and run.status == "queued"

            ben = _sign_in(browser, url, "ben@example.org")
            ben.goto(f"{url}/number_formats?run={run.id}")
            ben.get_by_role("button", name="Cancel run").click()
            expect(ben.get_by_text("was launched by ana@example.org; only they or an admin can cancel it")).to_be_visible(
                timeout=UI_TIMEOUT_MS)
            assert store.get(run.id).status == "queued"

            ana.get_by_role("button", name="Cancel run").click()
            deadline = time.time() + 30
            while store.get(run.id).status == "queued" and time.time() < deadline:
                time.sleep(0.2)
            rec = store.get(run.id)
            assert rec.status == "cancelled" and rec.error == "cancelled by ana@example.org before it started"

            for seed in (1, 2):  # two more queued runs, cancelled from the sidebar at once; Ben's stays queued
                ana.goto(f"{url}/number_formats?seed={seed}")
                ana.get_by_role("button", name="Run", exact=True).click()
                expect(ana.get_by_text("Queued: position")).to_be_visible(timeout=UI_TIMEOUT_MS)
            ben.goto(f"{url}/number_formats?seed=3")
            ben.get_by_role("button", name="Run", exact=True).click()
            expect(ben.get_by_text("Queued: position 3, behind 0 running and 2 queued")).to_be_visible(
                timeout=UI_TIMEOUT_MS)
            ana.get_by_role("button", name="Cancel my 2 queued run(s)").click()
            deadline = time.time() + 30
            while len(store.list(statuses=("queued",))) != 1 and time.time() < deadline:
                time.sleep(0.2)
            (left,) = store.list(statuses=("queued",))
            assert left.owner == "ben@example.org"
            expect(ben.get_by_text("Queued: position 1, behind 0 running and 0 queued")).to_be_visible(
                timeout=UI_TIMEOUT_MS)
        finally:
            browser.close()
