"""Serving for real: a continuous-batching engine on the tiny LLaMA (engine.py), its scheduler
(scheduler.py), and a simulator of it driven by a cost model fitted to the engine's steps (simulator.py)."""
