"""LLM Systems Explorer: `streamlit run app.py`. Routes to pages/ and shows the device and job queue."""
import streamlit as st

st.set_page_config(page_title="LLM Systems Explorer", page_icon="🧭", layout="wide")

from pages import ui  # noqa: E402  (after set_page_config)

navigation = st.navigation({
    "Explorer": [
        st.Page("pages/home.py", title="Overview", icon="🧭", default=True),
        st.Page("pages/runs.py", title="Runs", icon="🗂️", url_path="runs"),
    ],
    "Distributed": [
        st.Page("pages/collectives.py", title="Collectives, step by step", icon="🔁", url_path="collectives"),
        st.Page("pages/comm_bandwidth.py", title="Collective bandwidth", icon="📶", url_path="comm_bandwidth"),
        st.Page("pages/data_parallel.py", title="Data parallel & ZeRO", icon="🗂", url_path="data_parallel"),
        st.Page("pages/pipeline.py", title="Pipeline parallel", icon="🛤️", url_path="pipeline"),
    ],
    "Attention": [
        st.Page("pages/kv_cache.py", title="KV cache: MHA, MQA, GQA, MLA", icon="🗃️", url_path="kv_cache"),
        st.Page("pages/variants_train.py", title="Variants in training", icon="📉", url_path="variants_train"),
        st.Page("pages/flash_attention.py", title="FlashAttention", icon="⚡", url_path="flash_attention"),
    ],
    "Compilers": [
        st.Page("pages/autograd.py", title="Autograd", icon="🧮", url_path="autograd"),
        st.Page("pages/fusion.py", title="Autograd & fusion", icon="🔗", url_path="fusion"),
        st.Page("pages/placement.py", title="Graph placement", icon="🗺️", url_path="placement"),
    ],
    "Hardware": [
        st.Page("pages/memory_hierarchy.py", title="GPU memory hierarchy", icon="🧱", url_path="memory_hierarchy"),
    ],
    "Serving": [
        st.Page("pages/paged_attention.py", title="Paged attention", icon="📄", url_path="paged_attention"),
        st.Page("pages/serving.py", title="Serving: engine and simulator", icon=":material/speed:", url_path="serving"),
    ],
})
ui.sidebar()
navigation.run()
