"""This machine's memory hierarchy, measured (hardware.latency): load latency and read bandwidth per working-set size,
and Little's law applied to it, to seed 002's example and to the GPU presets."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui, units


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
