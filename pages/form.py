"""The settings form every experiment page shows, built from its Config's fields: each setting's widget, its
allowed range in the help, filled from the URL (validated on the server), else the opened run, else defaults."""
from __future__ import annotations

import math
from pathlib import Path

import streamlit as st

from backend import experiments
from backend.config import ConfigError
from pages.markup import escape


def url_settings(exp: experiments.Experiment) -> tuple[dict, ConfigError | None]:
    """Settings carried by the URL, validated on the server like any other input."""
    names = {f.name for f in exp.config_cls.fields()}
    raw = {k: st.query_params[k] for k in st.query_params if k in names}
    try:
        return {k: v for k, v in exp.make_config(raw).to_dict().items() if k in raw}, None
    except ConfigError as err:
        return {}, err


def settings_form(exp: experiments.Experiment, shown: dict | None = None, folded: dict[str, tuple[str, ...]] | None = None) -> dict | None:
    """A form built from the Config's fields, filled from the URL's settings, else the shown run's, else defaults;
    returns raw values when submitted, else None. `folded` names settings shown under a heading in a closed expander
    (opened when one of them is not at its default), after the rest."""
    from_url, url_error = url_settings(exp)
    if url_error:
        st.error(f"The link's settings were not used. {escape(url_error)}")
    defaults = {**exp.config_cls().to_dict(), **(shown or {})}
    fields = {f.name: f for f in exp.config_cls.fields()}
    folded = folded or {}
    in_fold = {n for names in folded.values() for n in names}
    if in_fold - set(fields):
        raise ValueError(f"{exp.name} has no settings {sorted(in_fold - set(fields))} to fold")
    initial = {n: from_url.get(n, defaults[n]) for n in fields}
    with st.form(f"settings-{exp.name}"):
        values = _widgets(exp, [f for n, f in fields.items() if n not in in_fold], initial)
        for heading, names in folded.items():
            changed = any(_listed(initial[n]) != _listed(fields[n].default) for n in names)
            with st.expander(heading, expanded=changed):
                values |= _widgets(exp, [fields[n] for n in names], initial)
        submitted = st.form_submit_button("Run", type="primary")
    return {n: values[n] for n in fields} if submitted else None


def _listed(value):
    """A list setting's value as a list (a stored run holds a list, the default a tuple); any other value as it is."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _widgets(exp: experiments.Experiment, fields: list, initial: dict) -> dict:
    """One widget per setting, three to a row, its allowed range in its help; what each holds, by setting."""
    cols, values = st.columns(3), {}
    for i, f in enumerate(fields):
        meta, t, value = f.metadata, exp.config_cls.field_type(f), initial[f.name]
        label, helptext = f.name, f"{meta.get('help', '')} (allowed: {exp.config_cls.allowed(f)})"
        key = f"{exp.name}.{f.name}"
        with cols[i % 3]:
            if exp.config_cls.item_type(f) is not None:  # a list setting, written comma-separated as in a URL
                values[f.name] = st.text_input(label, value=exp.config_cls.text_of(value), help=helptext, key=key)
            elif meta.get("choices"):
                choices = list(meta["choices"])  # a stored run's retired choice (model=mlp) shows the default
                index = choices.index(value if value in choices else f.default)
                values[f.name] = st.selectbox(label, choices, index=index, help=helptext, key=key)
            elif t is bool:
                values[f.name] = st.checkbox(label, value=value, help=helptext, key=key)
            elif t is int:
                values[f.name] = st.number_input(label, value=value, step=1, help=helptext, key=key)
            elif t is float:
                values[f.name] = st.number_input(label, value=float(value), step=float_step(value, meta), format="%g",
                                                 help=helptext, key=key)
            else:
                values[f.name] = st.text_input(label, value=value, help=helptext, key=key)
    return values


def float_step(value: float, meta: dict) -> float:
    """A step one decade below the value's leading digit (0.003 steps by 0.001), so a small value is shown and
    nudged at its own scale, never rounded to 0.00."""
    scale = abs(value) or abs(meta.get("max") or 1.0)
    return 10.0 ** math.floor(math.log10(scale)) if scale > 0 else 0.01


def trace_upload(experiment: str, arrival_unit: str, store_root: Path) -> None:
    """Your own request trace: checked and stored on the server under its content hash (in the run store at
    `store_root`), which the run's `trace` setting (and so the link) carries. Nothing on the server is read from a link."""
    from backend import uploads

    file = st.file_uploader(f"Your request trace (CSV: arrival in {arrival_unit}, prompt_len, output_len[, prefix_id, prefix_len])",
                            type="csv", max_upload_size=1, key="trace-upload",
                            help=f"at most {uploads.MAX_BYTES // 1024} KiB, {uploads.MAX_ROWS:,} rows, "
                                 f"arrivals up to {uploads.MAX_ARRIVAL:,} {arrival_unit}")
    if file is not None:
        _use_upload(experiment, "trace", lambda: uploads.save_trace(file.getvalue(), store_root))


def model_config_upload(experiment: str, store_root: Path) -> None:
    """Your own model's config.json: checked and stored on the server under its content hash (in the run store at
    `store_root`), which the run's `model` setting (and so the link) carries."""
    from backend import uploads
    from backend.plan import models

    file = st.file_uploader("Your model's config.json (Hugging Face format)", type="json", max_upload_size=1, key="config-upload",
                            help=f"at most {uploads.MAX_BYTES // 1024} KiB; hidden_size, num_hidden_layers, "
                                 "num_attention_heads, vocab_size and intermediate_size (or GPT-2's n_embd, n_layer, n_head) required")
    if file is not None:
        _use_upload(experiment, "model", lambda: models.save_config(file.getvalue(), store_root))


def _use_upload(experiment: str, field: str, save) -> None:
    """Store an upload (save() checks it and returns its content hash; ValueError says what is wrong) and make its hash
    the setting `field`, in the URL and in the form, while it is selected."""
    try:
        digest = save()
    except ValueError as err:
        st.error(escape(f"{field}: {err}"))
        return
    if st.query_params.get(field) != digest:
        st.query_params[field] = digest
        st.session_state[f"{experiment}.{field}"] = digest  # the form's field
    st.caption(f"Uploaded: the runs below use {field} `{digest[:12]}…` while it is selected.")
