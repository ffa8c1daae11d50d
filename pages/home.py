"""Overview: a map of the topics, each a link with one line on what runs there and how many runs it has."""
import streamlit as st

from pages import ui
from pages.catalog import SECTIONS

st.title("LLM Systems Explorer")
st.markdown(
    "How large language models are trained and served, where **every picture is drawn from a real "
    "computation run on the spot**: multiprocess torch.distributed on gloo, Triton kernels (natively on a GPU, "
    "interpreted on a CPU), real models. Every run is checked against an independent reference, and the "
    "error is shown beside the result. Runs are shared: everyone on this server sees them under **Runs**."
)
known = {e.name: e for e in ui.all_experiments()}
counts = ui.run_counts()
for section, topics in SECTIONS.items():
    if section == "Explorer":
        continue
    st.subheader(section)
    cols = st.columns(3)
    for i, topic in enumerate(topics):
        with cols[i % 3].container(border=True):
            st.page_link(topic.file, label=topic.title, icon=topic.icon)
            runs = sum(counts.get(name, 0) for name in topic.experiments)
            kinds = {"distributed: gloo ranks" if known[name].distributed else "one process"
                     for name in topic.experiments if name in known}
            # one element, not two: every element is a message the browser renders (this page is everyone's first)
            st.caption(f"{topic.what}  \n{', '.join(sorted(kinds))} · {runs} run{'s' if runs != 1 else ''} on this server")
shown = {name for topics in SECTIONS.values() for t in topics for name in t.experiments}
headless = sorted(set(known) - shown)
if headless:
    st.subheader("Headless only")
    for name in headless:
        st.markdown(f"`{name}`: {known[name].summary}")
st.caption("Headless: `python -m backend list`, `python -m backend run NAME --set key=value --json`.")
