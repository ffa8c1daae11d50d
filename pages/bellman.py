"""MDPs and the Bellman equations: a weather Markov reward process and a grid-world MDP."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Markov decision processes and the Bellman equations")


def log_curve(df: pd.DataFrame, y: str, title: str, color: str | None = None) -> alt.Chart:
    enc = dict(x=alt.X("iteration:Q", title="iteration k"), y=alt.Y(f"{y}:Q", title=title, scale=alt.Scale(type="log")),
               tooltip=["iteration", alt.Tooltip(f"{y}:Q", format=".3e")] + ([color] if color else []))
    if color:
        enc["color"] = alt.Color(f"{color}:N", title=None)
    return alt.Chart(df[df[y] > 0]).mark_line().encode(**enc).properties(height=260)


def render(result: dict, rec) -> None:
    t, cfg = result["tables"], rec.config
    st.subheader("Weather chain as a Markov reward process")
    left, right = st.columns(2)
    trans = pd.DataFrame(t["transition"])
    left.altair_chart(alt.Chart(trans).mark_rect().encode(
        x=alt.X("to:N", title="tomorrow", sort=None), y=alt.Y("from:N", title="today", sort=None),
        color=alt.Color("p:Q", title="P(s'|s)"), tooltip=["from", "to", alt.Tooltip("p:Q", format=".2f")]).properties(height=260)
        + alt.Chart(trans).mark_text().encode(x=alt.X("to:N", sort=None), y=alt.Y("from:N", sort=None), text=alt.Text("p:Q", format=".2f")),
        width="stretch")
    values = pd.DataFrame(t["values"])
    bars = alt.Chart(values).mark_bar(opacity=0.6).encode(
        x=alt.X("state:N", title=None, sort=None), y=alt.Y("linear_solve:Q", title="V(s)"),
        tooltip=["state", "reward", alt.Tooltip("linear_solve:Q", format=".5f"), alt.Tooltip("iteration:Q", format=".5f"),
                 alt.Tooltip("monte_carlo:Q", format=".4f"), alt.Tooltip("mc_stderr:Q", format=".4f")])
    mc = alt.Chart(values).mark_errorbar(color="black").encode(x=alt.X("state:N", sort=None), y=alt.Y("mc_low:Q", title="V(s)"), y2="mc_high:Q")
    right.altair_chart((bars + mc).properties(height=260), width="stretch")
    st.caption(f"Bars: V = (I − γP)⁻¹R with γ = {cfg['gamma']}. Black: Monte Carlo mean discounted return ± 2 standard errors.")
    conv = pd.DataFrame(t["convergence"]).melt(id_vars=["iteration"], value_vars=["error", "bound"], var_name="curve", value_name="max_error")
    conv["curve"] = conv["curve"].map({"error": "||V_k − V*|| measured", "bound": "γ^k·||V*|| (contraction bound)"})
    st.altair_chart(log_curve(conv, "max_error", "max |V_k(s) − V*(s)|", "curve"), width="stretch")

    st.subheader(f"Grid world: {cfg['layout']}")
    board = pd.DataFrame(t["board"])
    free, special = board[board["kind"] == "free"], board[board["kind"] != "free"]
    x, y = alt.X("col:O", axis=None), alt.Y("row:O", axis=None)
    cells = alt.Chart(free).mark_rect(stroke="white", strokeWidth=2).encode(
        x=x, y=y, color=alt.Color("value:Q", title="V*(s)", scale=alt.Scale(scheme="yellowgreen")),
        tooltip=["row", "col", alt.Tooltip("value:Q", title="V*(s)", format=".4f"),
                 alt.Tooltip("uniform_value:Q", title="V of the uniform policy", format=".4f")]
        + [alt.Tooltip(f"q_{m}:Q", title=f"q(s, {m})", format=".4f") for m in ("up", "right", "down", "left")])
    ends = alt.Chart(special).mark_rect(stroke="white", strokeWidth=2).encode(
        x=x, y=y, color=alt.Color("kind:N", legend=None, scale=alt.Scale(domain=["goal", "pit", "wall"], range=["#1a9850", "#d73027", "#555"])),
        tooltip=["row", "col", "kind"])
    arrows = alt.Chart(board).mark_text(fontSize=26, dy=-8, color="black").encode(x=x, y=y, text="action:N")
    vals = alt.Chart(free).mark_text(fontSize=11, dy=16).encode(x=x, y=y, text=alt.Text("value:Q", format=".3f"))
    st.altair_chart((cells + ends + arrows + vals).resolve_scale(color="independent")
                    .properties(height=90 * (board["row"].max() + 1)), width="stretch")
    st.caption(f"The optimal policy (arrows) and V* by policy iteration. Moves slip sideways with probability {cfg['slip']}; "
               f"entering a cell costs {cfg['step_reward']}, the goal pays +1 and the pit −1, γ = {cfg['grid_gamma']}.")
    left, right = st.columns(2)
    left.markdown("**Value iteration**: V ← max_a [R + γPV]")
    left.altair_chart(log_curve(pd.DataFrame(t["value_iteration"]), "residual", "max |V_k+1 − V_k|"), width="stretch")
    right.markdown("**Policy evaluation** of the uniform policy: V ← R^π + γP^πV")
    right.altair_chart(log_curve(pd.DataFrame(t["policy_evaluation"]), "update", "max |V_k+1 − V_k|"), width="stretch")
    st.markdown("**Policy iteration**: evaluate exactly (linear solve), act greedily, repeat until nothing changes.")
    ui.table(pd.DataFrame(t["policy_iteration"]))


ui.experiment_page("rl.bellman", render,
                   intro="V(s) = E[R_{t+1} + γ V(S_{t+1}) | S_t = s]: solved as a linear system, iterated as a contraction, "
                         "sampled by Monte Carlo; then maximised over actions in a grid world.")
