"""Benchmark: what one first render costs, page by page (issue #31's N = 10 target), for the pages bench/team_load.py
opens: the sign-in page, the Overview, the Number formats page's form, a queued run's live view and the run's result.
One person in one Chromium context (as team_load's people), each page opened REPEAT times; per open it records the
CPU seconds every Chromium process used (/proc: the browser, its renderer, GPU and network processes) from the
navigation to `SETTLE_S` after the page's element is drawn, the renderer main thread's time by DevTools
(Performance.getMetrics: tasks, script, layout, style), the page's DOM size, the WebSocket messages and bytes the
server sent, and the server's script runs for it with their CPU (its render log): a page open that runs the script
twice (a rerun on first load) shows as 2. The live view is measured idle over IDLE_S: Chromium's and the server's CPU
a second, and per tick. With --cpu-profile the renderer's JavaScript is sampled (DevTools Profiler) on one open of
each page and its self time summed by script and by function, so the JSON says where the browser's time goes.

    nice python bench/render_profile.py [--repeat 3] [--cpu-profile] [--out bench/results/render_profile.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend import limits  # noqa: E402
from backend.device import describe  # noqa: E402
from bench.team_load import CHROMIUM, CHROMIUM_ARGS, HOST, PAGE, TOKEN, WS_TIMING, read_events  # noqa: E402

SETTLE_S = 2.0   # after the element is drawn: the rest of the script's messages drawn too
IDLE_S = 12.0    # a page left open: its timers' cost (the sidebar's queue, a live run view)
MOVE_S = 5.0     # after a queued run moves up: the view's redraw or new period, and its ticks
RENDERER_METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration", "Nodes",
                    "LayoutObjects", "JSHeapUsedSize")


def chromium_cpu_s() -> float:
    """CPU seconds (user + system) of every live Chromium process below this one, so far."""
    total = 0.0
    for pid in limits.descendants(os.getpid()):
        try:
            if "chrom" in Path(f"/proc/{pid}/comm").read_text():
                total += limits.cpu_seconds(pid)
        except OSError:
            pass
    return total


async def metrics(cdp) -> dict[str, float]:
    got = (await cdp.send("Performance.getMetrics"))["metrics"]
    return {m["name"]: m["value"] for m in got if m["name"] in RENDERER_METRICS}


class Frames:
    """WebSocket frames the server sent to this page (DevTools Network events): count and payload bytes."""

    def __init__(self, cdp):
        self.count, self.bytes = 0, 0
        cdp.on("Network.webSocketFrameReceived", self._frame)

    def _frame(self, event: dict) -> None:
        self.count += 1
        self.bytes += len(event["response"].get("payloadData", ""))  # base64 for binary frames: about 4/3 of the bytes


def server_scripts(log: Path, person: str, t0: float, t1: float) -> list[dict]:
    """The server's script runs for this person that began in [t0, t1] (full runs: app.py's, per page open)."""
    return [e for e in read_events(log) if e["event"] == "script" and e.get("user") in (person, None)
            and t0 <= e["t0"] <= t1]


async def open_page(page, cdp, frames: Frames, url: str | None, ready, log: Path, person: str, profile: bool,
                    action=None) -> dict:
    """One navigation to `url` (or, with url None, `action(page)` on the page as it is: a click that redraws it),
    measured from its start to SETTLE_S after `ready` (a locator) is drawn."""
    m0, c0, f0, b0, t0 = await metrics(cdp), chromium_cpu_s(), frames.count, frames.bytes, time.time()
    if profile:
        await cdp.send("Profiler.enable")
        await cdp.send("Profiler.setSamplingInterval", {"interval": 200})
        await cdp.send("Profiler.start")
    start = time.monotonic()
    if url is None:
        await action(page)
    else:
        await page.goto(url, wait_until="commit")
    await ready(page).wait_for()
    drawn = time.monotonic() - start
    await asyncio.sleep(SETTLE_S)
    cpu_profile = (await cdp.send("Profiler.stop"))["profile"] if profile else None
    m1, c1, t1 = await metrics(cdp), chromium_cpu_s(), time.time()
    # the renderer's counters restart at each navigation (what it reports after is this document's); on the same
    # document they go on, and the action's share is the difference
    base = {k: 0.0 for k in m0} if url is not None else m0
    out = {"drawn_s": round(drawn, 3), "chromium_cpu_s": round(c1 - c0, 3),
           **{f"renderer_{k.removesuffix('Duration').lower()}_s": round(m1[k] - base[k], 3) for k in RENDERER_METRICS[:4]},
           "dom_nodes": int(m1["Nodes"]), "layout_objects": int(m1["LayoutObjects"]),
           "js_heap_mib": round(m1["JSHeapUsedSize"] / 2**20, 1),
           "ws_messages": frames.count - f0, "ws_kib": round((frames.bytes - b0) / 1024, 1),
           "elements": await page.locator("[data-testid='stElementContainer']").count()}
    scripts = server_scripts(log, person, t0, t1)
    out["server_script_runs"] = len(scripts)
    out["server_script_cpu_s"] = round(sum(e["cpu_s"] for e in scripts), 3)
    out["server_script_wall_s"] = round(sum(e["t1"] - e["t0"] for e in scripts), 3)
    if cpu_profile:
        out["js_self_time"] = js_self_time(cpu_profile)
    return out


def js_self_time(profile: dict, top: int = 12) -> dict:
    """The sampled profile's self time (s) summed by script (the bundle's chunks by file name) and by function."""
    nodes = {n["id"]: n for n in profile["nodes"]}
    gaps = profile.get("timeDeltas", [])
    by_node: dict[int, float] = {}
    for node_id, dt in zip(profile.get("samples", []), gaps):
        by_node[node_id] = by_node.get(node_id, 0.0) + dt / 1e6
    by_script: dict[str, float] = {}
    by_function: dict[str, float] = {}
    for node_id, s in by_node.items():
        frame = nodes[node_id]["callFrame"]
        script = frame["url"].rsplit("/", 1)[-1] or f"({frame['functionName'] or 'native'})"
        fn = f"{frame['functionName'] or '(anonymous)'} {script}:{frame['lineNumber']}"
        by_script[script] = by_script.get(script, 0.0) + s
        by_function[fn] = by_function.get(fn, 0.0) + s
    best = lambda d: {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}  # noqa: E731
    return {"total_s": round(sum(by_node.values()), 3), "by_script": best(by_script), "by_function": best(by_function)}


async def idle(page, log: Path, person: str, run_id: str | None) -> dict:
    """A page left open IDLE_S: Chromium's CPU and the server's script CPU a second, its timers' ticks."""
    c0, t0 = chromium_cpu_s(), time.time()
    await asyncio.sleep(IDLE_S)
    c1, t1 = chromium_cpu_s(), time.time()
    events = [e for e in read_events(log) if t0 <= e.get("t", e.get("t0", 0)) <= t1]
    ticks = sum(e["event"] == "tick" and e.get("run") == run_id for e in events)
    queue = sum(e["event"] == "queue_tick" and e.get("user") == person for e in events)
    span = t1 - t0
    return {"seconds": round(span, 1), "chromium_cpu_per_s": round((c1 - c0) / span, 3), "view_ticks": ticks,
            "queue_ticks": queue, "chromium_cpu_per_tick_s": round((c1 - c0) / max(1, ticks + queue), 3)}


async def person(url: str, log: Path, repeat: int, profile: bool, result_run: str) -> dict:
    from playwright.async_api import async_playwright

    name, out = "profiler", {}
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 900})
            await context.add_init_script(WS_TIMING)
            page = await context.new_page()
            page.set_default_timeout(120_000)
            cdp = await context.new_cdp_session(page)
            await cdp.send("Performance.enable")
            await cdp.send("Network.enable")
            frames = Frames(cdp)
            signin = [await open_page(page, cdp, frames, f"{url}/?token={TOKEN}",
                                      lambda pg: pg.get_by_role("button", name="Sign in"), log, name, False)]
            await page.get_by_label("Your name", exact=True).fill(name)
            await page.get_by_role("button", name="Sign in").click()
            await page.get_by_text("Job queue").wait_for()
            await asyncio.sleep(3)  # the cookies set
            form = f"{url}/{PAGE}?seed=7&sum_values=uniform&n_terms=100"
            pages = {"sign_in": None, "home": (f"{url}/", lambda pg: pg.get_by_text("Job queue")),
                     "number_formats_form": (form, lambda pg: pg.get_by_role("button", name="Run", exact=True))}
            opens = {"sign_in": signin}
            for key, target in pages.items():
                if target is None:
                    continue
                opens[key] = [await open_page(page, cdp, frames, target[0], target[1], log, name, profile and i == 0)
                              for i in range(repeat)]
            opens["run_click_to_queued_view"] = [await open_page(  # queued for good: the server runs none
                page, cdp, frames, None, lambda pg: pg.get_by_text("Queued: position"), log, name, False,
                action=lambda pg: pg.get_by_role("button", name="Run", exact=True).click())]
            run_id = page.url.split("run=")[-1].split("&")[0]
            live = f"{url}/{PAGE}?run={run_id}"
            opens["number_formats_queued_view"] = [
                await open_page(page, cdp, frames, live, lambda pg: pg.get_by_text("Queued: position"), log, name,
                                profile and i == 0) for i in range(repeat)]
            out["idle_queued_view"] = await idle(page, log, name, run_id)
            out["queue_move"] = await queue_move(page, url, log, name, run_id)
            opens["number_formats_result"] = [
                await open_page(page, cdp, frames, f"{url}/{PAGE}?run={result_run}",
                                lambda pg: pg.get_by_text("checks against independent references").first, log, name,
                                profile and i == 0) for i in range(repeat)]
            await page.goto(f"{url}/", wait_until="commit")
            await page.get_by_text("Job queue").wait_for()
            out["idle_home"] = await idle(page, log, name, None)
            out["run_id"] = run_id
            out["opens"] = opens
        finally:
            await browser.close()
    return out


async def queue_move(page, url: str, log: Path, person: str, ahead: str) -> dict:
    """A second run queued behind the first (`ahead`), its view open; the first is then cancelled in the store, so
    the view moves from second (polling every SLOW_POLL_S) to next (NEXT_POLL_S): the page's full script runs and
    Chromium's CPU over the MOVE_S after (a redraw of the page for the new period, or the view's timer set in place),
    beside its ticks."""
    from backend.store import RunStore

    await page.goto(f"{url}/{PAGE}?seed=8&sum_values=uniform&n_terms=100", wait_until="commit")
    await page.get_by_role("button", name="Run", exact=True).click()
    await page.get_by_text("Queued: position 2").wait_for()
    await asyncio.sleep(SETTLE_S)
    mine = page.url.split("run=")[-1].split("&")[0]
    c0, t0 = chromium_cpu_s(), time.time()
    RunStore(Path(os.environ["EXPLORER_DATA_DIR"])).finish(ahead, "cancelled", error="cancelled by the bench")
    await page.get_by_text("Queued: position 1").wait_for()
    seen = time.time() - t0
    await asyncio.sleep(MOVE_S - seen)
    c1, t1 = chromium_cpu_s(), time.time()
    events = [e for e in read_events(log) if t0 <= e.get("t", e.get("t0", 0)) <= t1]
    return {"seconds": round(t1 - t0, 1), "seen_s": round(seen, 3), "chromium_cpu_s": round(c1 - c0, 3),
            "full_script_runs": sum(e["event"] == "script" and e.get("user") == person for e in events),
            "view_ticks": sum(e["event"] == "tick" and e.get("run") == mine for e in events)}


def stored_run(data: Path) -> str:
    """A succeeded run of the page's experiment in the store at `data`, run headless (the CLI) before the server
    starts, whose result page is then measured (the server under test starts no runs)."""
    import subprocess

    from bench.team_load import EXPERIMENT, settings_of
    sets = [a for k, v in settings_of(0, 0).items() for a in ("--set", f"{k}={v}")]
    got = subprocess.run([sys.executable, "-m", "backend", "run", EXPERIMENT, *sets, "--json"], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, "EXPLORER_DATA_DIR": str(data)}, timeout=300)
    return Path(json.loads(got.stdout)["artifacts"]["result"]).parent.name


def summarise(opens: dict) -> dict:
    """Per page, the median over its opens of each figure (the first open of a page included)."""
    rows = {}
    for key, runs in opens.items():
        numeric = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
        rows[key] = {k: round(statistics.median(r[k] for r in runs), 3) for k in numeric}
        rows[key]["opens"] = len(runs)
    return rows


def main() -> None:
    from tests.browser.streamlit_server import start, stop

    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cpu-profile", action="store_true", help="sample the renderer's JavaScript on each page's first open")
    p.add_argument("--label", default="", help="a name for this measurement (before/after a change)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "render_profile.json"))
    args = p.parse_args()
    data = Path(tempfile.mkdtemp(prefix="render-profile-"))
    log = data / "render_log.jsonl"
    env = {"EXPLORER_TOKEN": TOKEN, "EXPLORER_MAX_JOBS": "0", "EXPLORER_OPEN_ON_DEFAULT_RUN": "0",
           "EXPLORER_RENDER_LOG": str(log)}
    result_run = stored_run(data)
    os.environ["EXPLORER_DATA_DIR"] = str(data)  # the store queue_move cancels a run in
    server, url = start(data, "--server.address", HOST, env=env, host=HOST)
    load0 = os.getloadavg()[0]
    try:
        got = asyncio.run(person(url, log, args.repeat, args.cpu_profile, result_run))
    finally:
        stop(server)
    row = {"label": args.label, "device": describe()["name"], "cpus": os.cpu_count(),
           "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)],
           "note": "one person in one Chromium context on the contended 2-core VM; CPU seconds are Chromium's own "
                   "processes (/proc), renderer_* the renderer main thread's wall time by DevTools",
           "pages": summarise(got["opens"]), "idle_queued_view": got["idle_queued_view"], "idle_home": got["idle_home"],
           "queue_move": got["queue_move"],
           "opens": got["opens"]}
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    old = old if isinstance(old, dict) and "runs" in old else {"runs": []}
    old["runs"] = [r for r in old["runs"] if r.get("label") != args.label] + [row]
    out.write_text(json.dumps(old, indent=1))
    for key, r in row["pages"].items():
        print(key, {k: r[k] for k in ("drawn_s", "chromium_cpu_s", "renderer_task_s", "renderer_script_s", "dom_nodes",
                                      "elements", "ws_messages", "ws_kib", "server_script_runs", "server_script_cpu_s")})
    print("idle queued view", row["idle_queued_view"], "idle home", row["idle_home"], "load", row["load_average"])
    print("queue move", row["queue_move"])
    for key, runs in got["opens"].items():
        if runs and runs[0].get("js_self_time"):
            print(key, json.dumps(runs[0]["js_self_time"])[:1500])


if __name__ == "__main__":
    main()
