"""Settings shared by plan.training and plan.search: the model (a shipped config or an uploaded one's hash) and the cluster."""
from __future__ import annotations


from backend.config import ConfigError, setting
from backend.plan import models as M
from backend.plan.clusters import GPUS, Cluster

GB = 1e9


def model_setting():
    return setting("llama-3-8b", help="a shipped config (" + ", ".join(M.shipped()) + ") or an uploaded config.json's hash")


def cluster_settings(gpu: str = "H100 SXM 80GB", nodes: int = 8):
    return {"gpu": setting(gpu, choices=tuple(GPUS), help="GPU preset (datasheet figures)"),
            "nodes": setting(nodes, min=1, max=16384, help="nodes"),
            "gpus_per_node": setting(8, choices=(1, 2, 4, 8), help="GPUs per node (NVLink inside a node)"),
            "network_gbps": setting(0.0, min=0.0, max=3200.0, help="network per GPU, Gb/s per direction (0: the preset's)")}


def load_model(config):
    try:
        return M.load(config.model)
    except ValueError as err:
        raise ConfigError("model", str(err)) from None


def cluster(config) -> Cluster:
    return Cluster(GPUS[config.gpu], config.nodes, config.gpus_per_node, config.network_gbps / 8 * GB or None)
