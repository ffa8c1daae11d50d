"""The plan of the every-page browser walk (test_every_page_browser.py), kept apart so the every-setting sweep can
leave out the runs the walk makes through the pages: the same settings, run once."""
import os

from pages.catalog import SECTIONS

TOPICS = [t for topics in SECTIONS.values() for t in topics]
# Pages that run something first; the Overview and Runs pages last, when there are runs to count and list.
ORDER = [t for t in TOPICS if t.experiments] + [t for t in TOPICS if not t.experiments]

# One choice of each page changed through its form (the rest at defaults), to a value that runs in seconds. Pages
# whose experiments have no choice or boolean setting (tensor and expert parallel, variants in training,
# speculative sampling, mixed precision) are not listed.
NON_DEFAULT = {
    "collectives": ("algo", "tree"), "comm_bandwidth": ("dtype", "float16"), "data_parallel": ("mode", "async"),
    "pipeline": ("schedule", "gpipe"), "context_parallel": ("split", "contiguous"), "kv_cache": ("variant", "mla"),
    "flash_attention": ("impl", "naive"), "nsa": ("kv_heads", "2"), "autograd": ("expression", "softmax"),
    "fusion": ("model", "mlp"), "placement": ("model", "mlp"), "memory_hierarchy": ("block", "32"),
    "gpu_execution": ("group_m", "1"), "paged_attention": ("policy", "recompute"), "paged_decode": ("first_writer", "child"), "serving": ("policy", "fcfs"),
    "moe_routing": ("renormalize", False), "number_formats": ("sum_values", "uniform"),
    "training_estimates": ("device", "H100 (SXM)"), "bellman": ("layout", "3x3"), "mesh_parallel": ("schedule", "zb_v"),
    "plan_training": ("recompute", "full"), "checkpoints": ("reshard_to", "ddp"),
}


def enabled() -> bool:
    return os.environ.get("EXPLORER_BROWSER_EVERY_PAGE", "1") != "0"


def covered_runs() -> set[tuple[str, str]]:
    """(experiment, one_at_a_time label) of every run the walk makes: each page's first experiment (the one its form
    opens on) at its defaults, and with the page's NON_DEFAULT choice."""
    covered = set()
    for topic in ORDER:
        if topic.experiments:
            covered.add((topic.experiments[0], "defaults"))
            if topic.url_path in NON_DEFAULT:
                field, value = NON_DEFAULT[topic.url_path]
                covered.add((topic.experiments[0], f"{field}={value}"))
    return covered
