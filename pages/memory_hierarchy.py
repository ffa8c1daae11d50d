"""GPU memory hierarchy and the roofline: presets beside this machine, measured; and this machine's own hierarchy,
measured by latency and bandwidth probes, with seed 002's latency-hiding arithmetic (Little's law)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import decode_view, latency_view, ui, units

st.title("GPU memory hierarchy and the roofline")
# Each roof's line by what its peak is: a GPU's two datasheet roofs differ in dash, the measured CPU's is solid.
PEAK_DASH = {"fp16/bf16 tensor (datasheet)": [7, 3], "fp32 (datasheet)": [2, 2], "fp32 (measured)": [1, 0]}


def peak(roof: dict) -> str:
    """Which peak a roof is drawn at: its precision, and whether that is a datasheet figure or measured here."""
    return f"{roof['precision']} ({'measured' if 'measured' in roof['device'] else 'datasheet'})"


def render(result: dict, rec) -> None:
    m, tables = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("this CPU: copy bandwidth", f"{m['cpu_bandwidth_GBps']:.1f} GB/s", help="measured: a 256 MiB copy, read + write")
    cols[1].metric("this CPU: fp32 matmul", f"{m['cpu_matmul_GFLOPs']:.1f} GFLOP/s", help="measured: the best of 256³, 512³ and 1024³, one thread")
    cols[2].metric("ridge point", f"{m['ridge_point_flops_per_byte']:.1f} FLOP/B")

    st.subheader("Roofline")
    lines = pd.DataFrame(tables["roof_lines"])
    lines["peak"] = [peak(r) for r in lines.to_dict("records")]
    lines["roof"] = lines["device"] + ", " + lines["peak"]
    roof = alt.Chart(lines).mark_line().encode(
        x=alt.X("intensity:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP/byte)"),
        y=alt.Y("attainable_flops_per_s:Q", scale=alt.Scale(type="log"), title="attainable FLOP/s", axis=alt.Axis(format="~s")),
        color=alt.Color("device:N"), detail="roof:N", tooltip=["roof", alt.Tooltip("attainable_flops_per_s:Q", format=".3s")],
        strokeDash=alt.StrokeDash("peak:N", title="peak", scale=alt.Scale(domain=list(PEAK_DASH), range=list(PEAK_DASH.values()))))
    measured = alt.Chart(pd.DataFrame(tables["points"])).mark_point(filled=True, size=80, color="black").encode(
        x="intensity:Q", y="flops_per_s:Q", shape=alt.Shape("kernel:N"),
        tooltip=["kernel", alt.Tooltip("intensity:Q", format=".2f"), alt.Tooltip("flops_per_s:Q", format=".3s"), "source"])
    model = alt.Chart(pd.DataFrame(tables["model_points"])).mark_point(size=60).encode(
        x="intensity:Q", y="attainable_flops_per_s:Q", color="device:N", shape=alt.Shape("kernel:N"),
        tooltip=["device", "kernel", alt.Tooltip("intensity:Q", format=".1f"), alt.Tooltip("attainable_flops_per_s:Q", format=".3s")])
    st.altair_chart((roof + model + measured).properties(height=420).interactive(), width="stretch")
    st.caption("Lines: presets (datasheet peaks: a model; each GPU twice, dashed at its fp16 tensor-core peak and dotted at its "
               "fp32 peak, e.g. the RTX 4090 at 165.2 and seed 003's 82.58 TFLOP/s) and this CPU (solid, measured). Black: measured runs on "
               "this CPU. Coloured points: where naive and flash attention of the chosen shape would sit on each GPU (model).")
    if m["ridge_4090_fp32_flops_per_byte"] is not None:  # None in a run of schema version 1
        st.caption(f"RTX 4090 fp32: its roof turns flat at {m['ridge_4090_fp32_flops_per_byte']:.2f} FLOP/B (found on the roofline); "
                   "seed 003's 82.58 TFLOPS ÷ 1.01 TB/s gives 81.76, checked in this run's checks.")

    st.subheader("The hierarchy, level by level")
    if not tables["hierarchy"]:  # a run of schema version 1
        st.caption("This run did not table every preset's hierarchy (stored before runs did): run it again to see it.")
        return
    every = pd.DataFrame(tables["hierarchy"])
    device = st.selectbox("device", list(dict.fromkeys(every["device"])), key=f"dev-{rec.id}")
    rows = every[every["device"] == device]

    def amount(values: pd.Series, unit: str, scale: float = 1.0) -> pd.Series:  # a link has no capacity, registers no bandwidth
        return values.map(lambda v: units.si(v * scale, unit) if pd.notna(v) else None)

    bandwidth = [units.rate(bw / 1e9) + (" (approx.)" if approx else "") if pd.notna(bw) else "none quoted"
                 for bw, approx in zip(rows["bandwidth_Bps"], rows["approximate"])]
    shown = pd.DataFrame({"level": rows["level"], "capacity": amount(rows["capacity_bytes"], "B"),
                          "bandwidth": bandwidth, "ops per datum (FP64)": rows["ops_per_datum_fp64"],
                          "naive bytes": amount(rows["naive_bytes"], "B"), "naive time": amount(rows["naive_seconds"], "µs", 1e6),
                          "flash bytes": amount(rows["flash_bytes"], "B"), "flash time": amount(rows["flash_seconds"], "µs", 1e6)})
    ui.table(shown, column_config={c: st.column_config.TextColumn(alignment="right") for c in shown.columns[1:]})
    with st.expander("Where each figure comes from"):
        st.markdown("\n".join(f"- **{level}**: {source}" for level, source in zip(rows["level"], rows["source"])))
    st.caption(f"Attention N={rec.config['seq_len']}, d={rec.config['head_dim']}, fp32, one head, tiles {rec.config['block']}: "
               "bytes from the IO model, time = bytes ÷ the level's bandwidth (a model). Seed 002: ops per datum = "
               "FP64 FLOP/s ÷ (bandwidth ÷ 8 B); the A100's L1 ≈ 8 and PCIe ≈ 6,240 are checked in the run.")


VIEWS = {"Roofline: presets and this machine": ("hardware.roofline", render,
                                                "Probes this machine's memory bandwidth and matmul throughput, measures attention "
                                                "and GEMMs on it, and sets them beside the rooflines of GPU presets."),
         "This machine's hierarchy, measured": ("hardware.latency", latency_view.render_measured,
                                                "Measures load latency (a pointer chase) and read bandwidth at each working-set "
                                                "size on the machine this server runs on, and applies Little's law to it, to "
                                                "seed 002's example and to the GPU presets."),
         "Decoding is memory-bound": ("hardware.decode", decode_view.render,
                                      "Times a decode step of a tiny LLaMA whose weights outgrow this CPU's caches at several batch "
                                      "sizes, beside the roofline's prediction, and places Llama 2 and 3 decode steps and a prefill "
                                      "on a GPU preset's roofline.")}
ui.experiment_views(VIEWS, key="memory-view")
