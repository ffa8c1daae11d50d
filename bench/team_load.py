"""Benchmark: a team on one server under load (issue #31). N simulated people (N = 1, 5, 10 by default) at once, each
in their own Chromium context: sign in with the server's token and their own name, open the Overview and the Number
formats page, press Run with their own settings (a distinct seed, so dedupe merges nothing; a small cheap run) and
read the result. The server runs with EXPLORER_MAX_JOBS=1, as a team server does, on a loopback address only
(127.0.0.2: loopback, but not one the app treats as local, so it asks for the token and a name).

Per N it reports: first render (navigation to the page's first element drawn) p50/p95; Run-to-result (the click to
the checks' verdict on the page, both on the page's own clock; the driver's figure, which adds Playwright's own
checks before the click and polling after, beside it) p50/p95 beside the store's own timestamps for the same run, split into queue wait
(created -> started) and run time (started -> finished), and their overhead (Run-to-result minus both: the page's
polling and drawing); errors (a person's flow that raised or a page that showed an exception); runs lost (a person
who pressed Run whose run is missing, not succeeded or not theirs) or doubled (more than one run for a person's settings); the server
process's peak RSS and CPU seconds. And the server's own share, read off its render log (EXPLORER_RENDER_LOG, written
by pages/render_log.py on the same clock): per render, the script run that produced the page (wall and CPU time)
beside the browser's time; per run, the overhead split into the click reaching the server, the server's submit
script, the run view noticing the end (its ticks are timed by the browser) and the script drawing the result; with the
N = 10 targets on the server's share beside the end-to-end ones (the browsers share the server's 2 cores). Each first
render is split by the page's own marks (Performance timing, the app's WebSocket opening and its first message) into
the document, the JS/CSS to DOMContentLoaded, the WebSocket's opening, the server's first answer and the drawing, with
the renderer main thread's time from DevTools; the CPU seconds of the server, its runs, Chromium and everyone else on
the machine, and the load average, are sampled through each N. Each N runs twice, all N people arriving together both
times: warm (the bundle cached by the sign-in page: a returning member) and cold (the cache off for the pages: a first
visit). What the server sends for its static assets (Cache-Control, Content-Encoding) is recorded. Bounded: every
wait has a limit, each N a time budget, and the server's process group and the browser are ended whatever happens.

Two layouts. "shared": all N people in Chromium on this box, their browsers on the server's 2 cores. "own": a team as
it is, each browser on its own machine: one person in Chromium here, whose timings are end to end, and N-1 on the wire
(bench/wire_person.py: Streamlit's protocol as the browser speaks it, the same page opens, Run and fragment timers),
so the server carries N people while this box runs one browser; `--rounds` repeats the arrival for more samples of
the Chromium person. The wire people's own figures (`*_wire`: to the script's end, no drawing) are reported apart.

    nice python bench/team_load.py [--people 1,5,10] [--cache warm,cold] [--layout shared,own] [--rounds 5]
                                   [--out bench/results/team_load.json]

Where the browser's time goes (bench/render_profile.py, one person page by page, bench/results/render_profile.json):
each page open is one script run on the server (no rerun on first load), 15-20 ms of its CPU (the result page 0.13 s);
in Chromium it costs 0.8-0.9 s of CPU for the Overview or a topic's form, 1.5-1.8 s for a result (3 Vega charts, 8
grids), 1.6-2.0 s for the sign-in page (the bundle's first fetch and compile), most of it Streamlit's frontend starting
on each navigation (a page of 16 elements costs what one of 74 does; a persistent profile's code cache saves about
10%). A live view's tick costs Chromium about 0.045 s, so a waiting page costs 0.09 of a core at 0.5 s, 0.045 at 1 s,
an idle one about 0.02. Ten people arriving together bring about 35 s of Chromium CPU for their first three pages:
on 2 cores shared with the server, its runs and other work, the last of them draws well past 3 s whatever the server
does; the N = 10 first-render target holds only where each person's browser has its own CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, urlencode, urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend import auth, limits  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.store import RunStore  # noqa: E402
from bench.wire_person import WirePage  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TOKEN = "team-load-bench-token"
HOST = "127.0.0.2"
EXPERIMENT, PAGE = "numerics.formats", "number_formats"
STEP_TIMEOUT_MS = 180_000   # one page load or one run's result, on a contended box
PHASE_BUDGET_S = 600.0      # one N, all people together
VERDICT = "checks against independent references"


CACHES = ("warm", "cold")
LAYOUTS = ("shared", "own")  # every person's browser on this box; or one here and the others on their own machines
OWN_FIRST = 1000  # the "own" layout's first person number


def settings_of(n: int, person: int, cache: str = "warm") -> dict:
    """Each person's own cheap run: a distinct seed (so no two people, in either cache pass, share a digest), 100
    uniform terms."""
    return {"seed": str(10_000 * n + 5_000 * CACHES.index(cache) + person), "sum_values": "uniform", "n_terms": "100"}


def person_name(n: int, person: int, cache: str = "warm") -> str:
    return f"person-{n}-{person}" + ("" if cache == "warm" else f"-{cache}")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values, None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))], 3)


def box_busy_s() -> float:
    """CPU seconds this machine's cores have spent busy since boot (every process's, /proc/stat), to set what the
    bench's own processes used beside what everyone else's did."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class ProcessSampler:
    """While one N runs (sampled every 0.25 s from /proc): the server's peak RSS, and the CPU seconds used by the
    server process, by the runs it started (its descendants), by Chromium (the bench's other descendants: the
    browser, its renderers, GPU and network processes) and by the whole machine, with the load average's samples.
    A process seen at the first sample counts from there; one that starts later counts from 0 (its whole life);
    one that ends between two samples loses at most 0.25 s of CPU."""

    def __init__(self, server_pid: int):
        self.pid, self.peak_rss, self._stop = server_pid, 0, threading.Event()
        self.box_start, self.load = box_busy_s(), [os.getloadavg()[0]]
        self._base: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._sample(first=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self, first: bool = False) -> None:
        server_tree = {self.pid, *limits.descendants(self.pid)}
        for pid in [os.getpid(), *limits.descendants(os.getpid())]:
            part = ("server" if pid == self.pid else "runs" if pid in server_tree else
                    "bench" if pid == os.getpid() else "chromium")
            used = limits.cpu_seconds(pid)
            if used <= 0:
                continue
            if first:
                self._base[pid] = used
            self._last[pid] = (part, used)
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)
        except OSError:
            pass

    def _loop(self) -> None:
        ticks = 0
        while not self._stop.wait(0.25):
            self._sample()
            ticks += 1
            if ticks % 20 == 0:  # every 5 s
                self.load.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        parts = {"server": 0.0, "runs": 0.0, "chromium": 0.0, "bench": 0.0}
        for pid, (part, used) in self._last.items():
            parts[part] += used - self._base.get(pid, 0.0)
        box = box_busy_s() - self.box_start
        self.load.append(os.getloadavg()[0])
        return {"server_peak_rss_mib": round(self.peak_rss / 2**20, 1), "server_cpu_s": round(parts["server"], 2),
                "cpu_s": {**{k: round(v, 2) for k, v in parts.items()}, "machine": round(box, 2),
                          "everyone_else": round(box - sum(parts.values()), 2)},
                "load_average": {"start": round(self.load[0], 1), "end": round(self.load[-1], 1),
                                 "mean": round(statistics.fmean(self.load), 1), "max": round(max(self.load), 1)}}


# Injected into every page before its own scripts: when the app's WebSocket was made, opened and first answered (the
# server's first message), on the page's clock (performance.now(), from the navigation's start).
WS_TIMING = """(() => {
  const t = window.__explorerTiming = {ws_created: null, ws_open: null, first_message: null, messages: 0};
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      if (t.ws_created === null) t.ws_created = performance.now();
      this.addEventListener('open', () => { if (t.ws_open === null) t.ws_open = performance.now(); });
      this.addEventListener('message', () => {
        t.messages += 1;
        if (t.first_message === null) t.first_message = performance.now();
      });
    }
  };
})();"""

# Read once the page's first element is drawn: the navigation's own marks and what its resources cost.
PAGE_TIMING = """() => {
  const n = performance.getEntriesByType('navigation')[0];
  const r = performance.getEntriesByType('resource').filter(e => !e.name.includes('/_stcore/'));
  const t = window.__explorerTiming || {};
  return {time_origin: performance.timeOrigin, response_end: n.responseEnd, dom_content_loaded: n.domContentLoadedEventEnd, load_end: n.loadEventEnd,
          ws_created: t.ws_created, ws_open: t.ws_open, first_message: t.first_message, messages: t.messages,
          resources: r.length, resources_from_cache: r.filter(e => e.transferSize === 0).length,
          transfer_bytes: n.transferSize + r.reduce((a, e) => a + e.transferSize, 0),
          body_bytes: n.decodedBodySize + r.reduce((a, e) => a + e.decodedBodySize, 0)};
}"""

# Installed just before Run is clicked: the person's own Run-to-result on the page's clock (epoch ms), from the click
# event reaching the page to the verdict's text added to the DOM (a MutationObserver reading only added nodes, so no
# layout is forced). The driver's figure (Playwright's click call to its wait returning) adds its own actionability
# checks before the click and its polling after the verdict, neither of which the person waits for.
RUN_TIMING = """(verdict) => {
  const t = window.__explorerRun = {click: null, verdict: null};
  document.addEventListener('click', () => { if (t.click === null) t.click = performance.timeOrigin + performance.now(); },
                            {capture: true});
  const has = node => (node.textContent || '').includes(verdict);
  const watch = new MutationObserver(records => {
    if (t.verdict !== null) return;
    for (const r of records) {
      if ((r.type === 'characterData' && has(r.target)) || [...r.addedNodes].some(has)) {
        t.verdict = performance.timeOrigin + performance.now();
        watch.disconnect();
        return;
      }
    }
  });
  watch.observe(document.body, {childList: true, subtree: true, characterData: true});
}"""

# Chromium's own accounting of a page's renderer main thread (DevTools Performance.getMetrics), in seconds.
BROWSER_METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def render_split(marks: dict, browser_cpu: dict, total_s: float, at: float) -> dict:
    """One first render (total_s from the bench's goto at wall time `at` to the element found drawn) split into parts
    that sum to it, by the page's own marks (ms from its navigation's start, which began at time_origin): start_s
    (the goto to the navigation's start), html_s (the document's response), assets_s (the JS and CSS fetched, parsed
    and run: to DOMContentLoaded), connect_s (the app booting to its WebSocket open), first_message_s (the open to the
    server's first message: the page's rerun request reaching the server and its script starting), draw_s (from then
    to the element found drawn: the script's output and the browser rendering it), with the renderer's main-thread
    time for the page beside it."""
    ms = lambda key: marks.get(key) or 0.0  # noqa: E731
    start = max(0.0, min(total_s, ms("time_origin") / 1000 - at)) if marks.get("time_origin") else 0.0
    cut = [0.0, ms("response_end"), ms("dom_content_loaded"), ms("ws_open"), ms("first_message")]
    for i in range(1, len(cut)):
        cut[i] = min(max(cut[i], cut[i - 1]), (total_s - start) * 1000)  # a missing mark (0) or one out of order adds nothing
    out = {"start_s": round(start, 3)}
    for name, a, b in zip(("html_s", "assets_s", "connect_s", "first_message_s"), cut, cut[1:]):
        out[name] = round((b - a) / 1000, 3)
    out["draw_s"] = round(total_s - start - cut[-1] / 1000, 3)
    out.update({k: marks.get(k) for k in ("resources", "resources_from_cache", "transfer_bytes", "body_bytes",
                                          "messages")})
    out.update(browser_cpu)
    return out


async def browser_metrics(cdp) -> dict[str, float]:
    """The page's renderer main thread so far in this document (Chromium resets them at each navigation): time in
    tasks, in JavaScript, in layout and style, in seconds of wall time (on a contended box, more than its CPU)."""
    got = (await cdp.send("Performance.getMetrics"))["metrics"]
    return {f"renderer_{m['name'].removesuffix('Duration').lower()}_s": round(m["value"], 3) for m in got
            if m["name"] in BROWSER_METRICS}


async def person(browser, url: str, n: int, i: int, cache: str = "warm") -> dict:
    """One person's visit; returns their timings and run id, or the error that stopped them. cache "warm": the two
    pages load with the bundle the sign-in page cached (a returning team member's browser); "cold": with the
    browser's cache off for them (a first-ever visit: every asset fetched and compiled again)."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout
    out: dict = {"person": person_name(n, i, cache), "index": i, "kind": "browser", "cache": cache, "first_render_s": [],
                 "first_render_at": [],
                 "first_render_page": [], "first_render_split": [], "run_id": None, "error": None}
    step = "sign in"
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    await context.add_init_script(WS_TIMING)
    page = await context.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    cdp = await context.new_cdp_session(page)
    await cdp.send("Performance.enable")
    try:
        start = time.monotonic()
        await page.goto(f"{url}/?token={TOKEN}", wait_until="commit")
        for attempt in range(1, 4):  # under heavy load a form submitted as it appears was seen lost: typed again
            out["sign_in_attempts"] = attempt
            await page.get_by_label("Your name", exact=True).fill(out["person"])
            await page.get_by_role("button", name="Sign in").click()
            try:
                await page.get_by_text("Job queue").wait_for(timeout=STEP_TIMEOUT_MS / 3)
                break
            except PlaywrightTimeout:
                if attempt == 3:
                    raise
        while {"explorer_auth", "explorer_name"} - {c["name"] for c in await context.cookies()}:  # set by the page
            if time.monotonic() - start > STEP_TIMEOUT_MS / 1000:
                raise TimeoutError("the sign-in cookies were not set")
            await asyncio.sleep(0.1)
        out["sign_in_s"] = round(time.monotonic() - start, 3)
        step = "open pages"
        await cdp.send("Network.enable")
        await cdp.send("Network.setCacheDisabled", {"cacheDisabled": cache == "cold"})
        for path in ("", f"{PAGE}?" + "&".join(f"{k}={v}" for k, v in settings_of(n, i, cache).items())):
            start, out_at = time.monotonic(), time.time()  # the wall clock: the server's log uses it too
            await page.goto(f"{url}/{path}", wait_until="commit")
            await (page.get_by_role("button", name="Run", exact=True) if path else page.get_by_text("Job queue")).wait_for()
            took = time.monotonic() - start
            marks, cpu = await page.evaluate(PAGE_TIMING), await browser_metrics(cdp)
            out["first_render_s"].append(round(took, 3))
            out["first_render_at"].append(out_at)
            out["first_render_page"].append(PAGE if path else "")
            out["first_render_split"].append(render_split(marks, cpu, took, out_at))
        await cdp.send("Network.setCacheDisabled", {"cacheDisabled": False})
        step = "run"
        await page.evaluate(RUN_TIMING, VERDICT)
        clicked = time.monotonic()
        await page.get_by_role("button", name="Run", exact=True).click()
        out["pressed_run"] = True
        await page.get_by_text(VERDICT).first.wait_for()
        out["run_to_result_driver_s"] = round(time.monotonic() - clicked, 3)
        marks = await page.evaluate("() => window.__explorerRun")
        out["clicked_at"] = marks["click"] / 1000
        out["run_to_result_s"] = round((marks["verdict"] - marks["click"]) / 1000, 3)
        out["run_id"] = (parse_qs(urlparse(page.url).query).get("run") or [None])[0]
        if await page.locator("[data-testid='stException']").count():
            out["error"] = "the page showed an exception"
    except Exception as err:  # a timeout or a vanished element: counted, the others go on
        out["error"] = f"{step}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        out["url_at_error"] = page.url
        if os.environ.get("TEAM_LOAD_SCREENSHOTS"):  # what the person saw when it stopped
            await page.screenshot(path=os.path.join(os.environ["TEAM_LOAD_SCREENSHOTS"], f"{out['person']}.png"))
    finally:
        await context.close()
    return out


async def wire_person(url: str, n: int, i: int, cache: str = "warm") -> dict:
    """One person whose browser is on their own machine (bench/wire_person.py), returning from an earlier visit (the
    sign-in cookies held): the same page opens, Run and wait for the verdict as `person`, each timed on the wire to
    the server's script finishing (no drawing)."""
    name = person_name(n, i, cache)
    out: dict = {"person": name, "index": i, "kind": "wire", "cache": cache, "first_render_s": [],
                 "first_render_at": [],
                 "first_render_page": [], "run_id": None, "error": None}
    cookie = f"{auth.COOKIE}={auth.session_proof(TOKEN)}; {auth.NAME_COOKIE}={quote(name)}"
    limit, step, tab = STEP_TIMEOUT_MS / 1000, "open pages", None
    try:
        for page, query in (("", ""), (PAGE, urlencode(settings_of(n, i, cache)))):
            if tab is not None:
                await tab.close()
            out_at = time.time()
            tab, took = await WirePage.open(url, page, query, cookie, limit)
            out["first_render_s"].append(round(took, 3))
            out["first_render_at"].append(out_at)
            out["first_render_page"].append(page)
        step = "run"
        clicked, out["clicked_at"] = time.monotonic(), time.time()
        await tab.press("Run", limit)
        out["pressed_run"] = True
        await tab.wait_for_text(VERDICT, limit)
        out["run_to_result_s"] = round(time.monotonic() - clicked, 3)
        out["run_id"] = (parse_qs(tab.query).get("run") or [None])[0]
    except Exception as err:  # a timeout or a closed connection: counted, the others go on
        out["error"] = f"{step}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        if tab is not None:
            await tab.close()
    return out


async def phase(url: str, n: int, cache: str = "warm", layout: str = "shared", rounds: int = 1) -> list[dict]:
    """`rounds` times, n people arriving together. Layout "shared": all of them in Chromium on this box; "own": one in
    Chromium here, the others on the wire, their browsers on their own machines (people numbered from OWN_FIRST, so
    no seed or name is another layout's)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        people: list[dict] = []
        try:
            first = OWN_FIRST if layout == "own" else 0
            for r in range(rounds):
                ids = range(first + r * n, first + (r + 1) * n)
                people += await asyncio.wait_for(asyncio.gather(*(
                    person(browser, url, n, i, cache) if layout == "shared" or i == ids[0]
                    else wire_person(url, n, i, cache) for i in ids)), PHASE_BUDGET_S)
            return people
        finally:
            await browser.close()


def account(store: RunStore, n: int, people: list[dict], cache: str = "warm") -> dict:
    """Each person's run in the store: timings split by the store's timestamps; runs lost or doubled."""
    rows, lost, doubled = [], 0, 0
    runs = [r for r in store.list(experiment=EXPERIMENT, limit=10_000)]
    for i, who in enumerate(people):
        seed = int(settings_of(n, who.get("index", i), cache)["seed"])
        mine = [r for r in runs if r.config.get("seed") == seed]
        doubled += max(0, len(mine) - 1)
        if not who.get("pressed_run"):  # stopped before pressing Run: an error, no run to lose
            continue
        rec = next((r for r in mine if r.status == "succeeded" and r.owner == who["person"]), None)
        if rec is None:
            lost += 1
            continue
        queue_s, run_s = rec.started - rec.created, rec.finished - rec.started
        rows.append({"person": who["person"], "run": rec.id, "queue_wait_s": round(queue_s, 3),
                     "run_time_s": round(run_s, 3), "run_to_result_s": who.get("run_to_result_s"),
                     "run_to_result_driver_s": who.get("run_to_result_driver_s"),
                     "overhead_driver_s": round(who["run_to_result_driver_s"] - queue_s - run_s, 3)
                     if who.get("run_to_result_driver_s") is not None else None,
                     "overhead_s": round(who["run_to_result_s"] - queue_s - run_s, 3)
                     if who.get("run_to_result_s") is not None else None})
    return {"rows": rows, "lost": lost, "doubled": doubled}


def read_events(path: Path) -> list[dict]:
    """The server's render log (pages/render_log.py): one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def server_renders(events: list[dict], people: list[dict]) -> list[dict]:
    """Each first render beside the server's script run that produced it: the first full run of app.py for that
    person and page that began after the navigation did. server_s is that run's wall time on the server, cpu_s its
    thread's CPU time, before_s the time from the navigation to the script's start (the page's shell loading in the
    browser and its WebSocket opening); the rest of the browser's time is the browser's."""
    rows = []
    for who in people:
        for at, took, page in zip(who["first_render_at"], who["first_render_s"], who["first_render_page"]):
            mine = [e for e in events if e["event"] == "script" and e["user"] == who["person"] and e["page"] == page
                    and at <= e["t0"] <= at + took]
            first = min(mine, key=lambda e: e["t0"], default=None)
            rows.append({"person": who["person"], "page": page or "home", "browser_s": took,
                         "server_s": round(first["t1"] - first["t0"], 3) if first else None,
                         "server_cpu_s": round(first["cpu_s"], 3) if first else None,
                         "before_s": round(first["t0"] - at, 3) if first else None})
    return rows


def server_overhead(events: list[dict], people: list[dict], store: RunStore, rows: list[dict]) -> None:
    """Split each run's overhead (Run-to-result minus queue and run) by the server's clock, in place, into parts that
    sum to it: click_s, the click to the start of the script run that queues the run (the browser sending the form;
    the server's share is only its loop picking the message up); submit_s, from then to the run's row in the store
    (the server's script); notice_s, the run's end to its run view noticing it (the view's polling: its ticks are
    timed by the browser, tick_gap_s the longest gap between ticks in the 5 s before the end); result_s, from then to
    the end of the script run that draws the result (the rerun's start and the script; verdict_s, its part up to the
    script drawing the checks' verdict, which the browser can show before the script ends); browser_s, what is left (the
    browser drawing it, negative when the verdict showed before the script ended: a script's output streams).
    server_overhead_s = submit_s + notice_s + result_s."""
    clicked = {p["person"]: p.get("clicked_at") for p in people}
    for row in rows:
        rec, at = store.get(row["run"]), clicked.get(row["person"])
        mine = [e for e in events if e["event"] == "script" and e.get("user") == row["person"]]
        queued_by = min((e["t0"] for e in mine if e["t0"] <= rec.created <= e["t1"]), default=None)
        seen = min((e["t"] for e in events if e["event"] == "final_seen" and e["run"] == row["run"]), default=None)
        ticks = sorted(e["t"] for e in events if e["event"] == "tick" and e["run"] == row["run"]
                       and rec.finished - 5 <= e["t"] <= (seen or rec.finished))
        drawn = min((e for e in mine if e.get("run") == row["run"] and seen is not None and e["t0"] >= seen),
                    key=lambda e: e["t0"], default=None)
        row["click_s"] = round(queued_by - at, 3) if at and queued_by else None
        row["submit_s"] = round(rec.created - queued_by, 3) if queued_by else None
        row["notice_s"] = round(seen - rec.finished, 3) if seen else None
        row["tick_gap_s"] = round(max(b - a for a, b in zip(ticks, ticks[1:])), 3) if len(ticks) > 1 else None
        row["result_s"] = round(drawn["t1"] - seen, 3) if drawn else None
        verdict = min((e["t"] for e in events if e["event"] == "verdict" and e["run"] == row["run"]
                       and seen is not None and e["t"] >= seen), default=None)
        row["verdict_s"] = round(verdict - seen, 3) if verdict else None
        row["result_cpu_s"] = round(drawn["cpu_s"], 3) if drawn else None
        row["browser_s"] = (round(at + row["run_to_result_s"] - drawn["t1"], 3)
                            if drawn and at and row["run_to_result_s"] is not None else None)
        parts = [row["submit_s"], row["notice_s"], row["result_s"]]
        row["server_overhead_s"] = round(sum(parts), 3) if None not in parts else None


SPLIT = ("start_s", "html_s", "assets_s", "connect_s", "first_message_s", "draw_s", "renderer_task_s",
         "renderer_script_s", "renderer_layout_s", "renderer_recalcstyle_s", "transfer_bytes", "body_bytes")


def stalled_views(events: list[dict], people: list[dict], store: RunStore, n: int, cache: str = "warm") -> list[dict]:
    """For each person who pressed Run and never saw the verdict: their run's state in the store, and the last time
    (seconds after the run ended, or after the click if it did not) that their run view ticked, their sidebar's queue
    ticked and any script of theirs ran, from the server's log: a view whose timers stopped shows as ticks that end."""
    runs = store.list(experiment=EXPERIMENT, limit=10_000)
    out = []
    for i, who in enumerate(people):
        if not who.get("pressed_run") or who.get("run_to_result_s") is not None:
            continue
        seed = int(settings_of(n, who.get("index", i), cache)["seed"])
        rec = next((r for r in runs if r.config.get("seed") == seed and r.owner == who["person"]), None)
        zero = (rec.finished if rec and rec.finished else None) or who.get("clicked_at") or 0.0
        last = lambda times: round(max(times) - zero, 3) if times else None  # noqa: E731
        out.append({"person": who["person"], "run": rec.id if rec else None, "status": rec.status if rec else None,
                    "from": "the run's end" if rec and rec.finished else "the click",
                    "last_view_tick_s": last([e["t"] for e in events if e["event"] == "tick" and rec and e["run"] == rec.id]),
                    "last_queue_tick_s": last([e["t"] for e in events if e["event"] == "queue_tick"
                                               and e.get("user") == who["person"]]),
                    "last_script_s": last([e["t0"] for e in events if e["event"] == "script"
                                           and e.get("user") == who["person"]]),
                    "watchdog_redraws": sum(e["event"] == "watchdog" and rec is not None and e["run"] == rec.id
                                            for e in events)})
        out[-1]["candidate"] = stall_candidate(events, who["person"], rec)
    return out


def stall_candidate(events: list[dict], person: str, rec) -> str:
    """Which of the ways a run view stops polling (tests/test_run_view.py) a stalled person's log matches: its ticks
    went on past the run's end (no redraw at a URL naming the run); they ended while the sidebar's went on, with a
    full script run of theirs after the last tick ("raised": a redraw that stopped before the view) or none
    ("dropped": the view's fragment left the server's storage, or its timer's message never reached the browser);
    every timer of the page ended (the browser stopped asking: a lost connection, or a redraw that stopped before the
    sidebar)."""
    if rec is None:
        return "no run in the store"
    view = [e["t"] for e in events if e["event"] == "tick" and e["run"] == rec.id]
    queue = [e["t"] for e in events if e["event"] == "queue_tick" and e.get("user") == person]
    scripts = [e["t0"] for e in events if e["event"] == "script" and e.get("user") == person]
    last_view = max(view, default=0.0)
    if rec.finished and last_view > rec.finished:
        return "ticks went on after the run ended, none redrew the page (no request whose URL named the run)"
    if not any(t > last_view for t in queue):
        return "every timer of the page stopped (the browser stopped asking, or a redraw stopped before the sidebar)"
    if any(t > last_view for t in scripts):
        return "raised: a full redraw after the view's last tick did not reach the view (an exception or st.stop)"
    return "dropped: the view's timer stopped while the sidebar's went on, with no redraw (its fragment left the " \
           "server's storage, or the message setting its timer never reached the browser)"


def summary(n: int, people: list[dict], runs: dict, wall_s: float, server: dict, renders_server: list[dict],
            cache: str = "warm") -> dict:
    """The phase's figures: end to end over the people in Chromium here; `*_wire` over those on the wire (the server's
    side of the same flow, their browsers elsewhere); the server's share from its render log over everyone."""
    browser = {p["person"] for p in people if p.get("kind", "browser") == "browser"}
    renders = [t for p in people if p["person"] in browser for t in p["first_render_s"]]
    wire_renders = [t for p in people if p["person"] not in browser for t in p["first_render_s"]]
    splits = [x for p in people for x in p.get("first_render_split", [])]
    served = lambda key: [r[key] for r in renders_server if r[key] is not None]  # noqa: E731
    col = lambda key, wire=False: [r[key] for r in runs["rows"]  # noqa: E731
                                   if r[key] is not None and (r["person"] in browser) != wire]
    out = {"people": n, "cache": cache, "in_chromium": len(browser), "on_the_wire": len(people) - len(browser),
           "wall_s": round(wall_s, 1), "pressed_run": sum(bool(p.get("pressed_run")) for p in people),
           "errors": sum(p["error"] is not None for p in people),
           "error_messages": [p["error"] for p in people if p["error"]], "runs_lost": runs["lost"],
           "runs_doubled": runs["doubled"], **server}
    for name, values in (("first_render", renders), ("run_to_result", col("run_to_result_s")),
                         ("run_to_result_driver", col("run_to_result_driver_s")),
                         ("overhead_driver", col("overhead_driver_s")),
                         ("queue_wait", col("queue_wait_s")), ("run_time", col("run_time_s")),
                         ("overhead", col("overhead_s")), ("first_render_server", served("server_s")),
                         ("first_render_server_cpu", served("server_cpu_s")), ("first_render_before_script", served("before_s")),
                         ("overhead_click", col("click_s")), ("overhead_submit", col("submit_s")),
                         ("overhead_notice", col("notice_s")), ("overhead_tick_gap", col("tick_gap_s")),
                         ("overhead_result_script", col("result_s")),
                         ("overhead_to_verdict", col("verdict_s")), ("overhead_browser", col("browser_s")),
                         ("overhead_server", col("server_overhead_s")), ("first_render_wire", wire_renders),
                         ("run_to_result_wire", col("run_to_result_s", wire=True)),
                         ("overhead_wire", col("overhead_s", wire=True))):
        out[f"{name}_p50_s"], out[f"{name}_p95_s"] = percentile(values, 50), percentile(values, 95)
    out["first_render_split"] = {key: {"p50": percentile([x[key] for x in splits if x.get(key) is not None], 50),
                                       "p95": percentile([x[key] for x in splits if x.get(key) is not None], 95)}
                                 for key in SPLIT}
    out["targets_n10"] = None
    if n >= 10:
        out["targets_n10"] = {
            "first_render_p95_under_3_s": out["first_render_p95_s"] is not None and out["first_render_p95_s"] < 3,
            "run_to_result_p95_within_1_s_of_queue_plus_run": out["overhead_p95_s"] is not None
            and out["overhead_p95_s"] <= 1.0,
            "no_errors": out["errors"] == 0, "none_lost_or_doubled": out["runs_lost"] == out["runs_doubled"] == 0}
    out["targets_n10_server"] = server_targets(out) if n >= 10 else None
    out["renders_detail"] = renders_server
    out["people_detail"] = people
    out["runs_detail"] = runs["rows"]
    return out


def server_targets(row: dict) -> dict:
    """The N = 10 targets on the server's own share (the browsers run on the same 2 cores): the script run that
    produces a page p95 under 3 s, and the server's part of the overhead (submit + notice + result) p95 within 1 s."""
    render, overhead = row.get("first_render_server_p95_s"), row.get("overhead_server_p95_s")
    return {"first_render_server_p95_under_3_s": render is not None and render < 3,
            "overhead_server_p95_within_1_s": overhead is not None and overhead <= 1.0}


def static_headers(url: str) -> dict:
    """What the server sends for the page's document and its largest hashed script (asked for gzip and brotli):
    status, Cache-Control, Content-Encoding and bytes, so the JSON records whether the bundle is cacheable and
    compressed rather than assuming it."""
    import re
    import urllib.request

    def get(path: str) -> tuple:
        req = urllib.request.Request(f"{url}/{path}", headers={"Accept-Encoding": "gzip, br"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.headers, resp.read()  # a case-insensitive mapping

    head, html = get("")
    scripts = re.findall(r'(?:src|href)="\.?/?(static/js/[^"]+\.js)"', html.decode())
    sized = []
    for script in scripts:
        headers, body = get(script)
        sized.append((len(body), script, headers))
    size, script, headers = max(sized) if sized else (0, None, {})
    pick = lambda h: {k.lower(): h.get(k) for k in ("Cache-Control", "Content-Encoding", "ETag")}  # noqa: E731
    return {"document": {"bytes": len(html), **pick(head)}, "scripts_named_by_document": len(scripts),
            "largest_script": {"path": script, "bytes_sent": size, **pick(headers)}}


def print_pass(row: dict, label: str, load: float) -> None:
    """One pass's figures on the terminal, as they land in the JSON."""
    split = {k: v["p95"] for k, v in row["first_render_split"].items()}
    print(f"{label}: first render p95 split {split}; cpu {row['cpu_s']}", flush=True)
    print(f"{label}: on the wire: first render p95 {row['first_render_wire_p95_s']} s, "
          f"overhead p95 {row['overhead_wire_p95_s']} s", flush=True)
    print(f"{label}: first render p50 {row['first_render_p50_s']} "
          f"p95 {row['first_render_p95_s']} s; "
          f"Run-to-result p50 {row['run_to_result_p50_s']} p95 {row['run_to_result_p95_s']} s (queue p95 "
          f"{row['queue_wait_p95_s']}, run p95 {row['run_time_p95_s']}, overhead p95 {row['overhead_p95_s']}); "
          f"server: render script p50 {row['first_render_server_p50_s']} p95 {row['first_render_server_p95_s']} "
          f"s, overhead p95 {row['overhead_server_p95_s']} s (submit {row['overhead_submit_p95_s']}, notice "
          f"{row['overhead_notice_p95_s']}, result script {row['overhead_result_script_p95_s']}; the click "
          f"reaching it p95 {row['overhead_click_p95_s']}); "
          f"errors {row['errors']}, lost {row['runs_lost']}, doubled {row['runs_doubled']}; server RSS "
          f"{row['server_peak_rss_mib']} MiB, CPU {row['server_cpu_s']} s; load {load:.1f}", flush=True)


def main() -> None:
    from tests.browser.streamlit_server import start, stop

    p = argparse.ArgumentParser()
    p.add_argument("--people", default="1,5,10", help="comma-separated counts of simultaneous people")
    p.add_argument("--cache", default="warm,cold", help="the browser cache for the pages after sign-in, each a pass "
                   "of its own: warm (a returning member: the bundle cached), cold (a first-ever visit)")
    p.add_argument("--layout", default="shared,own", help="where the people's browsers run, each a pass of its own: "
                   "shared (all N in Chromium on this box), own (one in Chromium here, N-1 on the wire: their browsers "
                   "on their own machines; skipped at N = 1, where it is the shared pass)")
    p.add_argument("--rounds", type=int, default=5, help="the own layout's rounds of N people arriving together (the "
                   "Chromium person's samples: 2 page opens and 1 run a round), 1 to 20")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "team_load.json"))
    args = p.parse_args()
    counts = [int(c) for c in args.people.split(",")]
    caches = [c for c in args.cache.split(",") if c]
    layouts = [c for c in args.layout.split(",") if c]
    if set(caches) - set(CACHES):
        p.error(f"--cache: {args.cache!r} (allowed: a comma-separated list of {', '.join(CACHES)})")
    if set(layouts) - set(LAYOUTS):
        p.error(f"--layout: {args.layout!r} (allowed: a comma-separated list of {', '.join(LAYOUTS)})")
    if not 1 <= args.rounds <= 20:
        p.error(f"--rounds: {args.rounds} (allowed: 1 to 20)")
    data = Path(tempfile.mkdtemp(prefix="team-load-"))
    render_log = data / "render_log.jsonl"  # the server's own time per script run (pages/render_log.py)
    env = {"EXPLORER_TOKEN": TOKEN, "EXPLORER_MAX_JOBS": "1", "EXPLORER_OPEN_ON_DEFAULT_RUN": "0",
           "EXPLORER_RENDER_LOG": str(render_log)}
    server, url = start(data, "--server.address", HOST, env=env, host=HOST)
    phases = []
    try:
        assets = static_headers(url)
        passes = [(layout, n, cache) for layout in layouts for n in counts for cache in caches
                  if layout == "shared" or n > 1]
        for layout, n, cache in passes:
            rounds = args.rounds if layout == "own" else 1
            load, sampler, begun = os.getloadavg()[0], ProcessSampler(server.pid), time.monotonic()
            people = asyncio.run(phase(url, n, cache, layout, rounds))
            wall = time.monotonic() - begun
            store, events = RunStore(data), read_events(render_log)
            runs = account(store, n, people, cache)
            server_overhead(events, people, store, runs["rows"])
            row = summary(n, people, runs, wall, sampler.stop(), server_renders(events, people), cache)
            row["stalled_views"] = stalled_views(events, people, store, n, cache)
            for stalled in row["stalled_views"]:  # a person who never saw their result, and which way it matches
                print(f"N={n:2d} {layout} {cache}: stalled {stalled}", flush=True)
            row["watchdog_redraws"] = sum(e["event"] == "watchdog" and e.get("user") in {p["person"] for p in people}
                                          for e in events)  # the run view's watchdog, for this phase's people
            row["load_average_at_start"] = round(load, 1)
            row["layout"], row["rounds"] = layout, rounds
            phases.append(row)
            print_pass(row, f"N={n:2d} {layout} {cache}", load)
    finally:
        stop(server)
    out = {"device": describe()["name"], "cpus": os.cpu_count(),
           "note": "measured on a 2-core VM (see each phase's load_average and cpu_s.everyone_else for other work). "
                   "Layout 'shared': Chromium with all N people's pages runs on the same 2 cores as the server and its "
                   "runs (cpu_s.chromium). Layout 'own': one person in Chromium here (end-to-end figures), N-1 on the "
                   "wire (Streamlit's protocol, their browsers on their own machines; *_wire figures), as a team's "
                   "server is used; the N = 10 targets are judged on it",
           "experiment": EXPERIMENT, "max_jobs": 1, "server": f"streamlit on {HOST} (loopback), one process",
           "static_assets": assets,
           "first_render_target": {
               "judged_on": "warm",
               "why": "the target is a team's day on its server: the bundle's scripts are content-hashed and sent "
                      "'immutable' for a year (static_assets), so a team member's browser fetches them once per "
                      "Streamlit version and every later visit is warm; the cold pass (the browser's cache off: "
                      "every script fetched and compiled again) is each person's first visit, reported beside it"},
           "phases": phases}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
