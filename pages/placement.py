"""Graph placement: a graph split across ranks with send/recv inserted, run on gloo, checked against one process."""

import pandas as pd
import streamlit as st

from pages import graph_view, timeline, ui

st.title("Placing a graph on devices")


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(4)
    cols[0].metric("ranks", m["ranks"], help="processes on gloo")
    cols[1].metric("ops per rank", " / ".join(map(str, m["ops_per_rank"])))
    cols[2].metric("send/recv pairs", m["transfers"], help=f"{m['bytes_moved']:,} B moved in all")
    cols[3].metric("makespan, measured", f"{m['measured_makespan_ms']:.3g} ms", f"modelled {m['modelled_makespan_ms']:.3g} ms",
                   delta_color="off", delta_arrow="off",
                   help=f"the run on this machine ({m['measured_makespan_ms']:.2f} ms) against the placement's model from "
                        f"the settings' rates ({m['modelled_makespan_ms']:.2f} ms)")
    st.caption("Colour is the rank; red dashed edges cross ranks and became a send on one rank and a recv on the other.")
    graph_view.graph(t["graph_dot"][0]["dot"])
    st.subheader("Why each op went where it did")  # full width: the reasons are sentences
    ui.table(pd.DataFrame(t["placement"]))
    left, right = st.columns(2)
    with left:
        st.subheader("Transfers")
        ui.table(pd.DataFrame(t["transfers"]),
                     column_config={"bytes": st.column_config.NumberColumn("bytes (B)", format="%d")})
    with right:
        st.subheader("Per rank")
        ui.table(pd.DataFrame(t["per_rank"]),
                     column_config={"compute_ms": st.column_config.NumberColumn("compute (ms)", format="%.2f")})
    timeline.run_timeline(rec, title="Per-rank timeline: compute, send, recv")


ui.experiment_page("graph.placement", render,
                   intro="Seed 002's two-server example: ops are placed on ranks by earliest finish time, edges that cross "
                         "ranks become send/recv pairs, each rank runs its part on gloo, and rank 0 gathers the outputs.")
