"""A person whose browser runs on their own machine, as the server sees them: Streamlit's own protocol over the app's
WebSocket (BackMsg rerun requests out, ForwardMsg deltas in), spoken as the browser speaks it, with no browser here.
bench/team_load.py uses it for the people of a team whose browsers are not on the server's cores: the server gets
what a browser sends (a page open is a new session whose first request names the page and its query; Run is the
form's submit trigger; a page's fragment timers, st.fragment(run_every=...), fire at their intervals), and each
request's time is measured to the script's end on the wire: the server's side of a page open, without the drawing."""
from __future__ import annotations

import asyncio
import time

import websockets
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

FINISHED, FRAGMENT_FINISHED = (ForwardMsg.ScriptFinishedStatus.Value(s) for s in
                               ("FINISHED_SUCCESSFULLY", "FINISHED_FRAGMENT_RUN_SUCCESSFULLY"))


class WirePage:
    """One browser tab's session: the page's widgets by label, its query string, its fragment timers (id -> seconds)
    and every text it has been sent (to wait for one to appear)."""

    def __init__(self, ws):
        self.ws, self.query, self.page_hash = ws, "", ""
        self.widgets: dict[str, str] = {}
        self.timers: dict[str, float] = {}
        self.texts: list[str] = []

    @classmethod
    async def open(cls, url: str, page: str, query: str, cookie: str, limit_s: float) -> tuple[WirePage, float]:
        """A new tab at url/page?query (a browser's navigation: a new session), with the browser's cookies; returns it
        and the seconds from the connection's start to the page's script finishing."""
        start = time.monotonic()
        ws = await websockets.connect(url.replace("http", "ws", 1) + "/_stcore/stream", subprotocols=["streamlit"],
                                      additional_headers={"Cookie": cookie}, max_size=None, open_timeout=limit_s)
        tab = cls(ws)
        tab.query = query
        await tab._rerun(page_name=page)
        await tab._until_finished(limit_s)
        return tab, time.monotonic() - start

    async def close(self) -> None:
        await self.ws.close()

    async def press(self, label: str, limit_s: float) -> None:
        """Click the button (or a form's submit button) labelled `label`: a rerun carrying its trigger."""
        await self._rerun(trigger=self.widgets[label])
        await self._until_finished(limit_s)

    async def wait_for_text(self, text: str, limit_s: float) -> None:
        """Until some element sent holds `text`, firing the page's fragment timers as the browser does (each at its own
        interval from when it was set; a full script run replaces them)."""
        deadline = time.monotonic() + limit_s
        due: dict[str, float] = {}
        while not self.saw(text):
            now = time.monotonic()
            due = {f: due.get(f, now + s) for f, s in self.timers.items()}
            if not due:
                raise RuntimeError(f"no timer left on the page and no {text!r}")
            fragment = min(due, key=due.get)
            if due[fragment] > deadline:
                raise TimeoutError(f"{text!r} did not appear in {limit_s:.0f} s")
            await asyncio.sleep(max(0.0, due[fragment] - now))
            await self._rerun(fragment=fragment)
            due[fragment] = time.monotonic() + self.timers.get(fragment, 0.0)
            await self._until_finished(deadline - time.monotonic())

    def saw(self, text: str) -> bool:
        return any(text in t for t in self.texts)

    async def _rerun(self, page_name: str | None = None, trigger: str | None = None, fragment: str | None = None):
        msg = BackMsg()
        state = msg.rerun_script
        state.query_string = self.query
        if page_name is not None:  # a navigation's first request names the page by its URL path
            state.page_name = page_name
        else:
            state.page_script_hash = self.page_hash
        if trigger:
            widget = state.widget_states.widgets.add()
            widget.id, widget.trigger_value = trigger, True
        if fragment:
            state.fragment_id, state.is_auto_rerun = fragment, True
        await self.ws.send(msg.SerializeToString())

    async def _until_finished(self, limit_s: float) -> None:
        """Read the server's messages until a script run (the app's or a fragment's) finishes."""
        deadline = time.monotonic() + limit_s
        while True:
            raw = await asyncio.wait_for(self.ws.recv(), max(0.01, deadline - time.monotonic()))
            msg = ForwardMsg()
            msg.ParseFromString(raw)
            kind = msg.WhichOneof("type")
            if kind == "navigation":  # st.navigation's page this run (new_session's hash is the app script's)
                self.page_hash = msg.navigation.page_script_hash
            elif kind == "new_session":
                if not msg.metadata.run.fragment_ids:  # the app's whole script: its timers are set anew
                    self.timers = {}
            elif kind == "stop_auto_rerun":
                for fragment in msg.stop_auto_rerun.fragment_ids:
                    self.timers.pop(fragment, None)
            elif kind == "page_info_changed":
                self.query = msg.page_info_changed.query_string
            elif kind == "auto_rerun":
                self.timers[msg.auto_rerun.fragment_id] = msg.auto_rerun.interval
            elif kind == "delta" and msg.delta.WhichOneof("type") == "new_element":
                self._read_element(msg.delta.new_element)
            elif kind == "script_finished" and msg.script_finished in (FINISHED, FRAGMENT_FINISHED):
                return

    def _read_element(self, element) -> None:
        inner = getattr(element, element.WhichOneof("type"))
        if getattr(inner, "id", "") and getattr(inner, "label", ""):
            self.widgets[inner.label] = inner.id
        self.texts += [value for _, value in inner.ListFields() if isinstance(value, str)]
