"""Overview: what the explorer is, and every experiment it can run."""
import pandas as pd
import streamlit as st

from backend import experiments
from pages import ui

st.title("LLM Systems Explorer")
st.markdown(
    "How large language models are trained and served, where **every picture is drawn from a real "
    "computation run on the spot**: multiprocess torch.distributed on gloo, Triton kernels (natively on a GPU, "
    "interpreted on a CPU), real models. Every run is checked against an independent reference, and the "
    "error is shown beside the result. Runs are shared: everyone on this server sees them under **Runs**."
)
st.page_link("pages/comm_bandwidth.py", label="Start with collective bandwidth", icon="📶")
rows = []
for exp in experiments.all_experiments():
    runs = ui.store().list(experiment=exp.name, limit=10_000)
    rows.append({"experiment": exp.name, "what it does": exp.summary,
                 "kind": "distributed (gloo ranks)" if exp.distributed else "single process",
                 "runs on this server": len(runs)})
st.subheader("Experiments")
st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
st.caption("Headless: `python -m backend list`, `python -m backend run NAME --set key=value --json`.")
