"""Serving for real. workload.py: request traces (ShareGPT-like, shared prefixes). scheduler.py: continuous
batching (FCFS or chunked prefill, prefix caching, preemption by swap or recompute), shared by both sides.
engine.py: each step one forward of the tiny LLaMA over the batch, KV in paged blocks; attention.py: attention
over block tables (batched PyTorch, the Triton kernel, a reference). simulator.py: the scheduler on a fitted
cost model. calibrate.py: profile, fit, fidelity. settings.py, report.py: the experiments' settings and rows."""
