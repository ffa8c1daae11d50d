"""GPU execution model: a tiled Triton GEMM, its grid, warps and threads, the traffic its counters measured
per tile shape, and where that intensity sits on each device's roofline."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("GPU execution model")


def _hierarchy(h: dict, cfg: dict) -> None:
    st.subheader("Grid → programs → warps → threads")
    cols = st.columns(5)
    cols[0].metric("programs", f"{h['programs']:,}", help=f"thread blocks: a grid of {h['grid'][0]} x {h['grid'][1]} tiles of C")
    cols[1].metric("warps per program", h["warps_per_program"])
    cols[2].metric("threads per program", h["threads_per_program"], help="warps x 32 threads, in lockstep within a warp (SIMT)")
    cols[3].metric("C elements per thread", f"{h['outputs_per_thread']:g}")
    cols[4].metric("waves", h["waves"] if h["waves"] is not None else "—",
                   help=f"on {cfg['device']}: {h['programs_per_sm']} programs fit per SM (limited by {h['limited_by']}) "
                        f"x {h['sms']} SMs (model)")
    levels = pd.DataFrame([
        {"level": "grid (the launch)", "in this GEMM": 1, "each does": f"C = A @ B as {h['grid'][0]} x {h['grid'][1]} tiles"},
        {"level": "program (thread block, on one SM)", "in this GEMM": h["programs"],
         "each does": f"one {cfg['block_m']}x{cfg['block_n']} tile of C in {h['k_steps']} K steps: {h['wmma_per_program']:,} "
                      f"16x16x16 WMMA-sized products; {h['shared_bytes_per_program']:,} B of A/B tiles staged in shared memory"},
        {"level": "warp (32 threads in lockstep, SIMT)", "in this GEMM": h["warps"],
         "each does": f"a {h['warp_tile'][0]}x{h['warp_tile'][1]} warp tile: {h['wmma_per_warp']:g} WMMA instructions, "
                      f"each {h['tensor_core_ops_per_wmma']} tensor-core 4x4x4 steps"},
        {"level": "thread", "in this GEMM": h["threads"],
         "each does": f"{h['outputs_per_thread']:g} C elements, {h['macs_per_thread']:,.0f} multiply-adds, "
                      f"{h['accumulator_registers_per_thread']} fp32 accumulator registers"},
    ])
    ui.table(levels)
    st.caption(f"A model of how the tiling maps onto the preset (Triton chooses the real layout); the counts of loads "
               f"are measured by the kernel. Edge tiles run whole: {h['useful_fraction']:.1%} of the multiply-adds issued "
               "are useful, the rest run on masked, padded rows and columns (SIMT: a warp executes as a unit, its idle "
               "lanes included).")


def _program_order(result: dict, cfg: dict) -> None:
    order = pd.DataFrame(result["tables"]["program_order"])
    left, right = st.columns(2)
    left.markdown(f"**Which program computed which tile of C**, recorded by the kernel (GROUP_M = {cfg['group_m']})")
    heat = alt.Chart(order).mark_rect(stroke="white").encode(
        x=alt.X("tile_n:O", title=f"tile column ({cfg['block_n']} columns of C)"),
        y=alt.Y("tile_m:O", title=f"tile row ({cfg['block_m']} rows of C)"),
        color=alt.Color("program:Q", title="program id", scale=alt.Scale(scheme="viridis")),
        tooltip=["program", "tile_m", "tile_n"])
    text = heat.mark_text(color="white", fontSize=10).encode(text="program:Q", color=alt.value("white"))
    left.altair_chart((heat + text).properties(height=260), width="stretch")
    h = result["tables"]["hierarchy"][0]
    warps = pd.DataFrame(result["tables"]["warp_tiles"])
    right.markdown(f"**One program's {cfg['block_m']}x{cfg['block_n']} tile split among its {h['warps_per_program']} warps**")
    right.altair_chart(alt.Chart(warps).mark_rect(stroke="white", strokeWidth=2).encode(
        x=alt.X("col0:Q", title="column in the tile", scale=alt.Scale(domain=[0, cfg["block_n"]])), x2="col1:Q",
        y=alt.Y("row0:Q", title="row in the tile", scale=alt.Scale(domain=[cfg["block_m"], 0])), y2="row1:Q",
        color=alt.Color("warp:N"), tooltip=["warp", "row0", "row1", "col0", "col1"]).properties(height=260), width="stretch")
    foot = pd.DataFrame(result["tables"]["largest_wave_footprint"])  # per case and GROUP_M, the largest wave's bytes
    st.markdown("**Bytes of A and B bands one wave of programs touches (a program per SM)**: what L2 must hold for "
                "the wave's repeated loads to hit; grouping tile-rows (GROUP_M) shrinks it (a model of the order, "
                "computed from the same program numbering).")
    for column, (case, part) in zip(st.columns(2), foot.groupby("case")):
        column.altair_chart(alt.Chart(part, title=case).mark_bar().encode(
            x=alt.X("bytes:Q", title="largest wave footprint (bytes)", axis=alt.Axis(format="~s")),
            y=alt.Y("group_m:O", title="GROUP_M"),
            tooltip=["group_m", alt.Tooltip("bytes:Q", format=",")]).properties(height=120), width="stretch")


def _intensity(result: dict) -> None:
    sweep = pd.DataFrame(result["tables"]["sweep"])
    if sweep.empty:
        return
    st.subheader("Arithmetic intensity against tile shape, from the kernel's counters")
    order = list(dict.fromkeys(sweep["tile"]))
    base = alt.Chart(sweep).encode(x=alt.X("tile:N", sort=order, title="BLOCK_M x BLOCK_N"))
    counted = base.mark_point(filled=True, size=90).encode(
        y=alt.Y("intensity counted:Q", title="FLOP per byte of global traffic"), color=alt.Color("size:N", title="M = N = K"),
        tooltip=["size", "tile", alt.Tooltip("bytes counted:Q", format=","), alt.Tooltip("intensity counted:Q", format=".3f"),
                 alt.Tooltip("loads_per_mac counted:Q", format=".4f")])
    formula = base.mark_line(strokeDash=[4, 3]).encode(y="intensity formula:Q", color="size:N")
    limit = base.mark_line(color="gray", strokeDash=[1, 2]).encode(y="intensity large-K limit:Q")
    st.altair_chart((formula + limit + counted).properties(height=320), width="stretch")
    st.caption("Points: 2·M·N·K ÷ bytes counted inside the kernel. Dashed: the closed form for the same tiling (a "
               "model); grey dotted: its limit for large K, 2 ÷ (elem·(1/BLOCK_M + 1/BLOCK_N)). A bigger tile re-reads "
               "A and B fewer times: loads per multiply-add = 1/BLOCK_M + 1/BLOCK_N.")
    roof = pd.DataFrame(result["tables"]["roofline"])
    st.markdown("**Where those intensities sit on each preset's fp16 tensor-core roofline** (model: the counts at 2 bytes "
                "per element, every global load served by device memory)")
    lines = pd.DataFrame(result["tables"]["roof_lines"]).rename(columns={"intensity": "intensity_fp16"})
    x = alt.X("intensity_fp16:Q", title="FLOP per byte (fp16)", scale=alt.Scale(type="log"))
    y = alt.Y("attainable_flops_per_s:Q", title="attainable FLOP/s", scale=alt.Scale(type="log"), axis=alt.Axis(format="~s"))
    roofs = alt.Chart(lines).mark_line(strokeDash=[5, 3]).encode(x=x, y=y, color=alt.Color("device:N"))
    points = alt.Chart(roof).mark_point(filled=True, size=60).encode(
        x=x, y=y, color="device:N", shape=alt.Shape("size:N", title="M = N = K"),
        tooltip=["device", "size", "tile", alt.Tooltip("intensity_fp16:Q", format=".2f"),
                 alt.Tooltip("attainable_flops_per_s:Q", format=".3s")])
    st.altair_chart((roofs + points).properties(height=320), width="stretch")
    st.caption("Dashed: each preset's roofline, min(fp16 tensor peak, device-memory bandwidth x intensity), datasheet figures. "
               "These tiles sit on the slope; even 128x128 tiles reach only 2 ÷ (2·(1/128 + 1/128)) = 64 FLOP/B "
               "if every load went to device memory, below each ridge: L2 serving the repeated bands is what lets a real "
               "GEMM reach its peak.")


def render(result: dict, rec) -> None:
    m, tables, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(4)
    cols[0].metric("GEMM, M×N×K", f"{cfg['m']}×{cfg['n']}×{cfg['k']}",
                   help=f"C ({cfg['m']}x{cfg['n']}) = A ({cfg['m']}x{cfg['k']}) @ B ({cfg['k']}x{cfg['n']}), {cfg['dtype']} on {m['device']}")
    cols[1].metric("bytes counted", f"{m['bytes_counted']:,}", help="A + B loads and C stores, inside the kernel")
    cols[2].metric("intensity", f"{m['intensity_flop_per_byte']:.2f} FLOP/B")
    cols[3].metric("loads per multiply-add", f"{m['loads_per_mac']:.4f}")
    ui.table(pd.DataFrame(tables["traffic"]))
    _hierarchy(tables["hierarchy"][0], cfg)
    _program_order(result, cfg)
    _intensity(result)
    st.subheader("Seed 002's count: a row loaded once, five columns, 25 multiply-adds")
    ui.table(pd.DataFrame(tables["seed_5x5"]))
    st.caption("Counted by running the kernel on a 1x5 row times a 5x5 matrix: A's row is read once (5 elements), B's "
               "five columns once each (25), for 25 multiply-adds. A BLOCK_M x BLOCK_N tile generalises it: "
               "(BLOCK_M + BLOCK_N)·K loads for BLOCK_M·BLOCK_N·K multiply-adds.")
    st.subheader("Tensor-core shapes: the granularity of tl.dot")
    ui.table(pd.DataFrame(tables["tensor_core_shapes"]))
    st.caption("A tensor core multiplies 4x4 by 4x4 and adds per cycle; CUDA groups them into a warp-wide 16x16x16 "
               "WMMA instruction, which is why tl.dot needs tiles of at least 16 on each side.")


ui.experiment_page(
    "hardware.gemm", render,
    intro="A tiled GEMM in Triton (interpreted on a CPU) whose loads and stores are counted as it runs, checked "
          "against torch.matmul and against the closed form; then how a GPU would execute it: grid, warps, threads, "
          "tensor cores, and the intensity each tile shape reaches.",
)
