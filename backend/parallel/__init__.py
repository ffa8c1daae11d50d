"""Parallel training strategies, one per module; pp/ holds pipeline parallelism."""
