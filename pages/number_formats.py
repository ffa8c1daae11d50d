"""Number formats: the bits of typed values, each format's range, FP16 swamping, plain vs Kahan summation."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import int8_view, ui

st.title("Number formats: FP32, TF32, BF16, FP16, FP8, INT8")


def bit_strip(row: pd.Series) -> pd.DataFrame:
    """One cell per stored bit, coloured by field: sign, exponent, mantissa."""
    fields = [("sign", row["sign_bit"]), ("exponent", row["exponent_bits"]), ("mantissa", row["mantissa_bits"])]
    cells = []
    for name, bits in fields:
        cells += [{"field": name, "bit": b, "position": len(cells) + i} for i, b in enumerate(bits)]
    return pd.DataFrame(cells)


def general(df: pd.DataFrame, digits: int = 6) -> dict:
    """Every float column in %g form, so 2^-126 reads 1.17549e-38 and not 0.0000…"""
    # beyond 2^53 the table shows raw digits for %g, so those columns use its scientific form
    return {c: st.column_config.NumberColumn(format="scientific" if df[c].abs().max() > 2**53 else f"%.{digits}g")
            for c in df.columns if df[c].dtype.kind == "f"}


def render(result: dict, rec) -> None:
    t = result["tables"]
    bits = pd.DataFrame(t["bits"])
    st.subheader("The bits of each value you typed")
    value = st.selectbox("value", sorted(bits["input"].unique(), key=list(bits["input"]).index), key=f"value-{rec.id}")
    shown = bits[bits["input"] == value]
    strips = pd.concat([bit_strip(r).assign(format=r["format"]) for _, r in shown.iterrows()])
    base = alt.Chart(strips).encode(x=alt.X("position:O", title="bit (most significant first)", axis=None),
                                    y=alt.Y("format:N", title=None, sort=list(shown["format"])))
    st.altair_chart((base.mark_rect(stroke="white").encode(
        color=alt.Color("field:N", scale=alt.Scale(domain=["sign", "exponent", "mantissa"], range=["#d62728", "#1f77b4", "#2ca02c"])),
        tooltip=["format", "field", "bit", "position"]) + base.mark_text(color="white").encode(text="bit:N"))
        .properties(height=38 * len(shown)), width="stretch")
    ui.table(shown[["format", "kind", "sign_bit", "exponent_bits", "mantissa_bits", "unbiased_exponent"]])  # two tables:
    ui.table(shown[["format", "stored_value", "relative_error", "gap_to_next", "gap_formula"]],  # one was cut at the right
             column_config={"stored_value": st.column_config.NumberColumn("stored value", format="%.10g"),
                            "gap_to_next": st.column_config.NumberColumn("gap to next (torch)", format="%.4g"),
                            "gap_formula": st.column_config.NumberColumn("gap 2^(e-bias-M)", format="%.4g"),
                            "relative_error": st.column_config.NumberColumn("relative rounding error", format="%.3g")})
    st.caption("Stored value: torch's cast. Gap to next: torch decoding the stored integer plus one, beside the formula.")

    st.subheader("Range and precision of each format")
    ranges = pd.DataFrame(t["ranges"])
    floats = ranges[ranges["format"] != "int8"]
    long = floats.melt(id_vars=["format"], value_vars=["smallest_subnormal", "smallest_normal", "max"],
                       var_name="limit", value_name="magnitude")
    st.altair_chart(alt.Chart(long).mark_point(filled=True, size=90).encode(
        x=alt.X("magnitude:Q", scale=alt.Scale(type="log"), title="magnitude (log scale)", axis=alt.Axis(format=".0e")),
        y=alt.Y("format:N", title=None, sort=list(floats["format"])), color=alt.Color("limit:N", title=None),
        tooltip=["format", "limit", alt.Tooltip("magnitude:Q", format=".4g")]).properties(height=240), width="stretch")
    formula = ["format", "exponent_bits", "mantissa_bits", "bias", "max", "smallest_normal", "smallest_subnormal", "eps",
               "decimal_digits"]
    config = general(ranges[formula], digits=4)
    for c, label in {"exponent_bits": "E bits", "mantissa_bits": "M bits", "smallest_normal": "min normal",
                     "smallest_subnormal": "min subnormal", "decimal_digits": "decimal digits"}.items():
        config[c] = {**config.get(c, {}), "label": label}
    ui.table(ranges[formula], column_config=config)
    torch_side = ranges[["format", "bits"] + [c for c in ranges if c.startswith(("finfo_", "iinfo_")) or c == "min"]]
    config = general(torch_side, digits=4)
    for c in torch_side.columns[2:]:
        config[c] = {**config.get(c, {}), "label": c.replace("_", " ", 1).replace("_", " ")}
    ui.table(torch_side, column_config=config)
    st.caption("Above: max, smallest normal, smallest subnormal and eps from E, M and the bias; below: torch.finfo. "
               "INT8 (seed 002's inference format) has no exponent: -128 .. 127 in steps of 1, against torch.iinfo.")

    st.subheader("Seed 002's swamping: weight 2⁻³ plus gradient 2⁻¹⁴")
    swamp = pd.DataFrame(t["swamping"])
    ui.table(swamp, column_config=general(swamp, digits=10))
    st.markdown("In FP16 the gap above 2⁻³ is 2⁻¹³, so 2⁻¹⁴ is exactly half a gap: a tie, which rounds to the even "
                "neighbour, 2⁻³. The update is lost. BF16 (7 mantissa bits) loses it too; FP32 keeps it.")

    st.subheader("Summing many small values")
    sums = pd.DataFrame(t["sums"])
    st.altair_chart(alt.Chart(sums).mark_line().encode(
        x=alt.X("terms:Q", title="values added"), y=alt.Y("running_sum:Q", title="running sum"),
        color=alt.Color("method:N", title=None), strokeDash="method:N",
        tooltip=["method", "terms", alt.Tooltip("running_sum:Q", format=".6g")]).properties(height=300), width="stretch")
    errors = pd.DataFrame(t["sum_errors"])
    ui.table(errors, column_config=general(errors, digits=8))
    stall = result["metrics"]["fp16_stall_prediction"]  # None where the values do not stall a plain FP16 sum
    if stall:
        st.markdown(f"Model: a plain FP16 sum of a constant v stops at the first 2^k whose half-gap 2^(k−11) is at least v: "
                    f"**{stall:g}** predicted; measured **{result['metrics']['fp16_plain_sum']:g}**. Kahan's compensation "
                    "carries the lost low part and reaches the exact sum to within FP16's own rounding of it.")


VIEWS = {"Floating-point formats": ("numerics.formats", render,
                                    "Type numbers: each is stored in every format by torch, its bits read back, and the rounding, "
                                    "decoding and gap re-derived from the formulas with exact rational arithmetic."),
         "INT8 quantisation": ("numerics.int8", int8_view.render,
                               "Trains the tiny LLaMA, stores its weights in INT8 with per-channel scales, and runs it weight-only "
                               "and INT8 × INT8 → INT32, and with an INT8 KV cache, against fp32.")}
ui.experiment_views(VIEWS, key="formats-view")
