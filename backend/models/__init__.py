"""Models: a tiny LLaMA-style decoder with pluggable attention."""
