"""This machine measured (latency and bandwidth probes) and how a GPU executes work (the execution hierarchy)."""
