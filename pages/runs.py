"""Every run on this server, filterable, each openable by URL (?run=ID)."""
import json
import time

import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Runs")

run_id = ui.url_run_id()
if run_id:
    if st.button("← All runs"):
        del st.query_params["run"]
        st.rerun()
    rec = ui.store().get(run_id)
    ui.show_run(run_id)
    if rec and rec.status == "succeeded":
        with st.expander("Settings and metrics", expanded=True):
            left, right = st.columns(2)
            left.json(rec.config)  # st.json shows values as data, never as Markdown
            right.json(rec.result()["metrics"])
        timeline.run_timeline(rec, title="Trace timeline")
    st.stop()

names = [e.name for e in ui.all_experiments()]
left, right = st.columns(2)
chosen = left.selectbox("Experiment", ["(all)"] + names, index=0)
statuses = right.multiselect("Status", ["queued", "running", "succeeded", "failed", "cancelled"])
records = ui.runs_of(chosen, statuses=tuple(statuses) or None) if chosen != "(all)" else ui.store().list(statuses=tuple(statuses) or None)
if not records:
    st.info("No runs match. Launch one from a topic page, or `python -m backend run NAME` in a terminal.")
    st.stop()
df = pd.DataFrame([{
    "run": r.id, "experiment": ui.experiment_of(r), "status": r.status,  # a table draws no icon: ":material/...:" was shown as text
    "created": time.strftime("%m-%d %H:%M", time.localtime(r.created)),
    "took (s)": round(r.duration_s, 1) if r.duration_s is not None else None,
    "origin": r.origin, "owner": r.owner, "settings": json.dumps(r.config), "link": f"runs?run={r.id}",
} for r in records])
st.caption(f"{len(df)} runs. Click a row to open it.")
event = ui.table(df, on_select="rerun", selection_mode="single-row",
                     column_config={"link": st.column_config.LinkColumn("link", display_text="open", width=50),
                                    "settings": st.column_config.TextColumn("settings", width=100,
                                                                            help="the run's settings (JSON); open the run for all")})
if event.selection.rows:
    st.query_params["run"] = df.iloc[event.selection.rows[0]]["run"]
    st.rerun()
