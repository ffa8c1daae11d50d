"""GPU memory hierarchy and the roofline: presets beside this machine, measured."""
import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

from backend.memory.devices import APPROXIMATE, DEVICES, hierarchy_traffic, ops_per_datum
from pages import ui

st.title("GPU memory hierarchy and the roofline")


def render(result: dict, rec) -> None:
    m, tables = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("this CPU: copy bandwidth", f"{m['cpu_bandwidth_GBps']:.1f} GB/s", help="measured: a 256 MiB copy, read + write")
    cols[1].metric("this CPU: fp32 matmul", f"{m['cpu_matmul_GFLOPs']:.1f} GFLOP/s", help="measured: 1024³, one thread")
    cols[2].metric("ridge point", f"{m['ridge_point_flops_per_byte']:.1f} FLOP/B")

    st.subheader("Roofline")
    intensities = np.logspace(-1, 3, 60)
    lines = [{"device": r["device"], "roof": f"{r['device']}, {r.get('precision', 'fp16/bf16 tensor')}", "intensity": x,
              "flops_per_s": min(r["peak_flops"], r["bandwidth"] * x)} for r in tables["roofs"] for x in intensities]
    roof = alt.Chart(pd.DataFrame(lines)).mark_line().encode(
        x=alt.X("intensity:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP/byte)"),
        y=alt.Y("flops_per_s:Q", scale=alt.Scale(type="log"), title="attainable FLOP/s", axis=alt.Axis(format="~s")),
        color=alt.Color("device:N"), detail="roof:N", tooltip=["roof", alt.Tooltip("flops_per_s:Q", format=".3s")],
        strokeDash=alt.condition(alt.datum.device == "this CPU (measured)", alt.value([1, 0]), alt.value([5, 3])))
    measured = alt.Chart(pd.DataFrame(tables["points"])).mark_point(filled=True, size=80, color="black").encode(
        x="intensity:Q", y="flops_per_s:Q", shape=alt.Shape("kernel:N"),
        tooltip=["kernel", alt.Tooltip("intensity:Q", format=".2f"), alt.Tooltip("flops_per_s:Q", format=".3s"), "source"])
    model = alt.Chart(pd.DataFrame(tables["model_points"])).mark_point(size=60).encode(
        x="intensity:Q", y="attainable_flops_per_s:Q", color="device:N", shape=alt.Shape("kernel:N"),
        tooltip=["device", "kernel", alt.Tooltip("intensity:Q", format=".1f"), alt.Tooltip("attainable_flops_per_s:Q", format=".3s")])
    st.altair_chart((roof + model + measured).properties(height=420).interactive(), width="stretch")
    st.caption("Lines: presets (dashed, datasheet peaks: a model; each GPU twice, at its fp16 tensor-core peak and its fp32 peak, "
               "e.g. the RTX 4090 at 165.2 and seed 003's 82.58 TFLOP/s) and this CPU (solid, measured). Black: measured runs on "
               "this CPU. Coloured points: where naive and flash attention of the chosen shape would sit on each GPU (model).")

    st.subheader("The hierarchy, level by level")
    device = st.selectbox("device", list(DEVICES), key=f"dev-{rec.id}")
    sram = m["io_model.sram_bytes_per_step"]
    steps = (rec.config["seq_len"] / rec.config["block"]) ** 2
    rows = pd.DataFrame(hierarchy_traffic(device, m["io_model.standard_bytes"], m["io_model.flash_bytes"], sram * steps))
    opd = ops_per_datum(device) if "fp64 tensor" in DEVICES[device]["peak_flops"] else {}
    rows["ops per datum (FP64)"] = rows["level"].map(opd)
    rows["bandwidth"] = rows.apply(lambda r: (f"{r['bandwidth_Bps'] / 1e9:,.0f} GB/s" + (" (approx.)" if (device, r["level"]) in APPROXIMATE else ""))
                                   if pd.notna(r["bandwidth_Bps"]) else "—", axis=1)
    st.dataframe(rows[["level", "capacity_bytes", "bandwidth", "ops per datum (FP64)", "naive_bytes", "flash_bytes", "naive_seconds", "flash_seconds"]],
                 hide_index=True, width="stretch",
                 column_config={"capacity_bytes": st.column_config.NumberColumn("capacity", format="%.3e B"),
                                "naive_bytes": st.column_config.NumberColumn("naive bytes", format="%.3e"),
                                "flash_bytes": st.column_config.NumberColumn("flash bytes", format="%.3e"),
                                "naive_seconds": st.column_config.NumberColumn("naive time at this bandwidth (s)", format="%.2e"),
                                "flash_seconds": st.column_config.NumberColumn("flash time (s)", format="%.2e")})
    st.caption(f"Attention N={rec.config['seq_len']}, d={rec.config['head_dim']}, fp32, one head, tiles {rec.config['block']}: "
               "bytes from the IO model, time = bytes ÷ the level's bandwidth (a model). Seed 002: ops per datum = "
               "FP64 FLOP/s ÷ (bandwidth ÷ 8 B); the A100's L1 ≈ 8 and PCIe ≈ 6,240 are checked in the run.")


ui.experiment_page("memory.roofline", render,
                   intro="Probes this machine's memory bandwidth and matmul throughput, measures attention and GEMMs on it, "
                         "and sets them beside the rooflines of GPU presets.")
