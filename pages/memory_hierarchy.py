"""GPU memory hierarchy and the roofline: presets beside this machine, measured; and this machine's own hierarchy,
measured by latency and bandwidth probes, with seed 002's latency-hiding arithmetic (Little's law)."""
import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

from backend.memory.devices import APPROXIMATE, DEVICES, SOURCES, hierarchy_traffic, ops_per_datum
from pages import decode_view, ui, units

st.title("GPU memory hierarchy and the roofline")
# Each roof's line by what its peak is: a GPU's two datasheet roofs differ in dash, the measured CPU's is solid.
PEAK_DASH = {"fp16/bf16 tensor (datasheet)": [7, 3], "fp32 (datasheet)": [2, 2], "fp32 (measured)": [1, 0]}


def peak(roof: dict) -> str:
    """Which peak a roof is drawn at: its precision, and whether that is a datasheet figure or measured here."""
    return f"{roof.get('precision', 'fp16/bf16 tensor')} ({'measured' if 'measured' in roof['device'] else 'datasheet'})"


def render(result: dict, rec) -> None:
    m, tables = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("this CPU: copy bandwidth", f"{m['cpu_bandwidth_GBps']:.1f} GB/s", help="measured: a 256 MiB copy, read + write")
    cols[1].metric("this CPU: fp32 matmul", f"{m['cpu_matmul_GFLOPs']:.1f} GFLOP/s", help="measured: the best of 256³, 512³ and 1024³, one thread")
    cols[2].metric("ridge point", f"{m['ridge_point_flops_per_byte']:.1f} FLOP/B")

    st.subheader("Roofline")
    intensities = np.logspace(-1, 3, 60)
    lines = [{"device": r["device"], "roof": f"{r['device']}, {peak(r)}", "peak": peak(r), "intensity": x,
              "flops_per_s": min(r["peak_flops"], r["bandwidth"] * x)} for r in tables["roofs"] for x in intensities]
    roof = alt.Chart(pd.DataFrame(lines)).mark_line().encode(
        x=alt.X("intensity:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP/byte)"),
        y=alt.Y("flops_per_s:Q", scale=alt.Scale(type="log"), title="attainable FLOP/s", axis=alt.Axis(format="~s")),
        color=alt.Color("device:N"), detail="roof:N", tooltip=["roof", alt.Tooltip("flops_per_s:Q", format=".3s")],
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
    if "ridge_4090_fp32_flops_per_byte" in m:
        st.caption(f"RTX 4090 fp32: its roof turns flat at {m['ridge_4090_fp32_flops_per_byte']:.2f} FLOP/B (found on the roofline); "
                   "seed 003's 82.58 TFLOPS ÷ 1.01 TB/s gives 81.76, checked in this run's checks.")

    st.subheader("The hierarchy, level by level")
    device = st.selectbox("device", list(DEVICES), key=f"dev-{rec.id}")
    sram = m["io_model.sram_bytes_per_step"]
    steps = (rec.config["seq_len"] / rec.config["block"]) ** 2
    rows = pd.DataFrame(hierarchy_traffic(device, m["io_model.standard_bytes"], m["io_model.flash_bytes"], sram * steps))
    opd = ops_per_datum(device) if "fp64 tensor" in DEVICES[device]["peak_flops"] else {}
    rows["ops per datum (FP64)"] = rows["level"].map(opd)
    rows["bandwidth"] = rows.apply(lambda r: (units.rate(r["bandwidth_Bps"] / 1e9) + (" (approx.)" if (device, r["level"]) in APPROXIMATE else ""))
                                   if pd.notna(r["bandwidth_Bps"]) else "none quoted", axis=1)

    def amount(values: pd.Series, unit: str, scale: float = 1.0) -> pd.Series:  # a link has no capacity, registers no bandwidth
        return values.map(lambda v: units.si(v * scale, unit) if pd.notna(v) else None)

    shown = pd.DataFrame({"level": rows["level"], "capacity": amount(rows["capacity_bytes"], "B"),
                          "bandwidth": rows["bandwidth"], "ops per datum (FP64)": rows["ops per datum (FP64)"],
                          "naive bytes": amount(rows["naive_bytes"], "B"), "naive time": amount(rows["naive_seconds"], "µs", 1e6),
                          "flash bytes": amount(rows["flash_bytes"], "B"), "flash time": amount(rows["flash_seconds"], "µs", 1e6)})
    ui.table(shown, column_config={c: st.column_config.TextColumn(alignment="right") for c in shown.columns[1:]})
    with st.expander("Where each figure comes from"):
        st.markdown("\n".join(f"- **{level}**: {SOURCES.get((device, f'level:{level}'), 'no source')}" for level in rows["level"]))
    st.caption(f"Attention N={rec.config['seq_len']}, d={rec.config['head_dim']}, fp32, one head, tiles {rec.config['block']}: "
               "bytes from the IO model, time = bytes ÷ the level's bandwidth (a model). Seed 002: ops per datum = "
               "FP64 FLOP/s ÷ (bandwidth ÷ 8 B); the A100's L1 ≈ 8 and PCIe ≈ 6,240 are checked in the run.")


def render_measured(result: dict, rec) -> None:
    m, tables = result["metrics"], result["tables"]
    cols = st.columns(4)
    cols[0].metric("L1 load latency", f"{m['l1_latency_ns']:.2f} ns", help="pointer chase in the smallest working set")
    cols[1].metric("largest working set", f"{m['largest_latency_ns']:.0f} ns", help="pointer chase past the last cache")
    cols[2].metric("peak read bandwidth", units.rate(m["peak_read_GBps"]))
    cols[3].metric("DRAM-size read bandwidth", units.rate(m["largest_read_GBps"]))
    probes = pd.DataFrame(tables["probes"])
    caches = pd.DataFrame(tables["caches"])
    rules = alt.Chart(caches).mark_rule(strokeDash=[4, 3], color="gray").encode(
        x="bytes:Q", tooltip=["level", alt.Tooltip("bytes:Q", format=",", title="capacity (bytes)"), "shared_by"])
    labels = alt.Chart(caches).mark_text(align="left", baseline="top", dx=3, color="gray").encode(
        x="bytes:Q", y=alt.value(2), text="level:N")
    x = alt.X("bytes:Q", title="working set", scale=alt.Scale(type="log", base=2), axis=alt.Axis(
        labelExpr="datum.value >= 1048576 ? format(datum.value / 1048576, '~r') + ' MiB' : format(datum.value / 1024, '~r') + ' KiB'"))
    latency = alt.Chart(probes).mark_line(point=True).encode(
        x=x, y=alt.Y("ns_per_load:Q", title="load latency (ns)", scale=alt.Scale(type="log")),
        tooltip=[alt.Tooltip("bytes:Q", format=","), alt.Tooltip("ns_per_load:Q", format=".2f"), "fits_in"])
    bandwidth = alt.Chart(probes).mark_line(point=True, color="#e4572e").encode(
        x=x, y=alt.Y("read_GBps:Q", title="read bandwidth (GB/s)"),
        tooltip=[alt.Tooltip("bytes:Q", format=","), alt.Tooltip("read_GBps:Q", format=".2f"), "fits_in"])
    left, right = st.columns(2)
    left.altair_chart((latency + rules + labels).properties(height=320, title="Pointer chase: one dependent load at a time"), width="stretch")
    right.altair_chart((bandwidth + rules + labels).properties(height=320, title="Reading the working set over and over"), width="stretch")
    st.caption("Dashed: the cache sizes the kernel reports for this CPU. Latency steps where the working set outgrows a level.")

    st.subheader("Little's law: bytes in flight = latency x bandwidth")
    st.markdown(f"Seed 002: 89 ns x 131 GB/s = **{m['seed_bytes_in_flight']:,.0f} bytes** must be in flight; the 16 bytes "
                f"of one ax+b are **{m['seed_one_request_percent']:.2f}%** of that, so about **{m['seed_requests_needed']:,.0f}** "
                f"requests (the Xeon 8280's 729 threads) keep memory busy. A CPU at 2,000 GFLOP/s FP64 and 200 GB/s needs "
                f"**{m['seed_ops_per_datum']:.0f}** operations per datum.")
    flight = pd.DataFrame([{"where": f"this CPU, {r['level']} (measured)", "bytes in flight": r["bytes_in_flight"]} for r in tables["levels"]] +
                          [{"where": "seed 002's CPU (89 ns x 131 GB/s)", "bytes in flight": m["seed_bytes_in_flight"]}] +
                          [{"where": f"{r['device']} {r['memory']} (model)", "bytes in flight": r["bytes_in_flight"]}
                           for r in tables["gpu_littles_law"]])
    flight["from"] = 1.0  # a log axis has no zero: each bar starts at one byte
    bars = alt.Chart(flight).encode(
        y=alt.Y("where:N", sort=None, title=None, axis=alt.Axis(labelLimit=320)),
        color=alt.condition("indexof(datum.where, 'measured') >= 0", alt.value("#1f6fd1"), alt.value("#9aa5b1")),
        tooltip=["where", alt.Tooltip("bytes in flight:Q", format=",.0f")])
    x = alt.X("bytes in flight:Q", scale=alt.Scale(type="log"), axis=alt.Axis(format="~s"), title="bytes that must be in flight")
    st.altair_chart((bars.mark_rule(strokeWidth=8).encode(x=x, x2="from:Q") + bars.mark_point(filled=True, size=80).encode(x=x))
                    .properties(height=240), width="stretch")
    st.caption("A dependent chase keeps one 64-byte line in flight; everything to the right of 64 bytes has to come from "
               "independent requests: out-of-order cores and prefetchers on a CPU, tens of thousands of threads on a GPU.")
    st.markdown("**This machine, per level** (measured latency and bandwidth of the probe that fits in it):")
    levels = pd.DataFrame(tables["levels"])
    levels["capacity_bytes"] = levels["capacity_bytes"].map(lambda b: units.binary(b) if pd.notna(b) else "past the last cache")
    levels["probe_bytes"] = levels["probe_bytes"].map(units.binary)
    ui.table(levels, column_config={
        "capacity_bytes": st.column_config.TextColumn("capacity", alignment="right"),
        "probe_bytes": st.column_config.TextColumn("probe's working set", alignment="right"),
        "latency_ns": st.column_config.NumberColumn("latency (ns)", format="%.1f"),
        "read_GBps": st.column_config.NumberColumn("read (GB/s)", format="%.1f"),
        "bytes_in_flight": st.column_config.NumberColumn("bytes in flight", format="localized"),
        "lines_in_flight_needed": st.column_config.NumberColumn("64-B lines in flight", format="%.1f"),
        "one_chase_uses": st.column_config.NumberColumn("one chase uses", format="percent")})
    st.markdown("**GPU presets** (model: the assumed latency x the datasheet bandwidth; threads of one request each, "
                "beside the threads the chip can keep resident):")
    ui.table(pd.DataFrame(tables["gpu_littles_law"]), column_config={
        "bandwidth_GBps": st.column_config.NumberColumn("bandwidth (GB/s)", format="localized"),
        "assumed_latency_ns": st.column_config.NumberColumn("latency (ns, assumed)", format="%.0f"),
        "bytes_in_flight": st.column_config.NumberColumn("bytes in flight", format="localized"),
        "threads_needed": st.column_config.NumberColumn("threads needed", format="localized"),
        "threads_resident_max": st.column_config.NumberColumn("threads resident (max)", format="localized"),
        "needed_over_resident": st.column_config.NumberColumn("needed / resident", format="percent")})


VIEWS = {"Roofline: presets and this machine": ("memory.roofline", render,
                                                "Probes this machine's memory bandwidth and matmul throughput, measures attention "
                                                "and GEMMs on it, and sets them beside the rooflines of GPU presets."),
         "This machine's hierarchy, measured": ("hardware.latency", render_measured,
                                                "Measures load latency (a pointer chase) and read bandwidth at each working-set "
                                                "size on the machine this server runs on, and applies Little's law to it, to "
                                                "seed 002's example and to the GPU presets."),
         "Decoding is memory-bound": ("memory.decode", decode_view.render,
                                      "Times a decode step of a tiny LLaMA whose weights outgrow this CPU's caches at several batch "
                                      "sizes, beside the roofline's prediction, and places Llama 2 and 3 decode steps and a prefill "
                                      "on a GPU preset's roofline.")}
shown = ui.store().get(st.query_params["run"]) if "run" in st.query_params else None
default = next((view for view, (name, _, _) in VIEWS.items() if shown and shown.experiment == name), next(iter(VIEWS)))
view = st.segmented_control("view", list(VIEWS), default=default, key="memory-view") or default
name, view_render, intro = VIEWS[view]
if shown and shown.experiment != name:  # the linked run belongs to the other view
    del st.query_params["run"]
ui.experiment_page(name, view_render, intro=intro)
