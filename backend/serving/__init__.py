"""Serving for real. workload.py: the one request-trace model (ShareGPT-like, shared prefixes, CSV). scheduler.py:
the one continuous-batching scheduler (FCFS or chunked prefill, prefix caching, preemption by swap or recompute),
booking KV in a block manager. engine.py: each step one forward of the tiny LLaMA over the batch, KV in paged
blocks; attention.py: attention over block tables (batched PyTorch, the Triton kernel, the reference).
simulator.py: the scheduler on a fitted cost model. allocator_sim.py: the scheduler with no model, paged blocks
against contiguous reservations (kvcache.serve). calibrate.py: profile, fit, fidelity. settings.py, report.py:
the experiments' settings and rows."""
