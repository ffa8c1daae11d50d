"""MoE routing: softmax top-k, Switch top-1 with capacity, DeepSeek-V3 group-limited routing with bias balancing."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Mixture of experts: routing")


def render(result: dict, rec) -> None:
    cfg, t, m = rec.config, result["tables"], result["metrics"]
    st.subheader("Load per expert for each router (same tokens, same router weights)")
    ui.table(pd.DataFrame(t["summary"]))
    loads = pd.DataFrame(t["loads"])  # each expert's load, and the perfectly balanced one beside it
    bars = alt.Chart(loads).mark_bar().encode(
        x=alt.X("expert:O", title="expert"), y=alt.Y("tokens:Q", title="tokens processed"),
        tooltip=["router", "expert", "tokens", alt.Tooltip("balanced:Q", title="balanced share", format=".2f")])
    rule = alt.Chart(loads).mark_rule(strokeDash=[4, 4], color="black").encode(y="balanced:Q")
    order = [r["router"] for r in t["summary"]]
    st.altair_chart(alt.layer(bars, rule, data=loads).properties(height=120, width=560)
                    .facet(row=alt.Row("router:N", title=None, sort=order, header=alt.Header(labelAngle=0, labelAlign="left"))))
    st.caption(f"Dashed: a perfectly balanced load. Switch top-1 sends each token to one expert with capacity "
               f"{m['switch_capacity']} tokens (capacity factor {cfg['capacity_factor']}); {m['switch_dropped_tokens']} tokens "
               "over capacity were dropped and are not counted in its bars.")

    st.subheader("Auxiliary-loss-free balancing (DeepSeek-V3)")
    left, right = st.columns(2)
    bal = pd.DataFrame(t["balancing"]).melt(id_vars=["step"], value_vars=["max_load_over_mean", "min_load_over_mean"],
                                            var_name="measure", value_name="ratio")
    left.altair_chart(alt.Chart(bal).mark_line(point=True).encode(
        x=alt.X("step:Q", title="bias update step"), y=alt.Y("ratio:Q", title="expert load ÷ mean load"),
        color=alt.Color("measure:N", title=None), tooltip=["step", "measure", alt.Tooltip("ratio:Q", format=".3f")])
        .properties(height=260), width="stretch")
    right.altair_chart(alt.Chart(pd.DataFrame(t["bias"])).mark_bar().encode(
        x=alt.X("expert:O", title="expert"), y=alt.Y("bias:Q", title="final bias (added to sigmoid scores)"),
        tooltip=["expert", alt.Tooltip("bias:Q", format=".3f")]).properties(height=260), width="stretch")
    st.caption(f"Each step: route, count the load with bincount, then bias += {cfg['bias_rate']} · sign(mean load − load). "
               "The bias only changes which experts are chosen; the weights stay the unbiased scores.")

    st.subheader(f"DeepSeek-V3's gate step by step on the first {len(t['walkthrough'][0]['values'])} tokens")
    st.caption(f"{cfg['n_experts']} experts in {cfg['n_groups']} groups, {cfg['topk_groups']} groups kept, top-{cfg['top_k']}, "
               f"route_scale {cfg['route_scale']}, the balanced bias. One row per token.")
    for step in t["walkthrough"]:
        st.markdown(f"**{step['step']}** · shape {tuple(step['shape'])}")
        st.code(step["code"], language="python")
        values = pd.DataFrame(step["values"])  # narrow columns: 16 experts fit the page
        ui.table(values, hide_index=False, column_config={
            c: st.column_config.NumberColumn(width=44, format="%.2f" if values[c].dtype.kind == "f" else "%d") for c in values})


ui.experiment_page("models.moe_routing", render,
                   intro="One batch of tokens through three routers and a layer of SwiGLU experts. Every routing, load, "
                         "balance loss and layer output is checked against a one-token-at-a-time Python implementation.")
