"""The hardware as a model and as measured: GPU presets with their sources (devices.py), roofline arithmetic and
probes of this machine (roofline.py, latency.py), a decode step on the roofline (decode.py), and how a GPU executes
a tiled kernel (execution.py)."""
