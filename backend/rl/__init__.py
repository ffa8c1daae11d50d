"""Reinforcement learning foundations: MRPs, MDPs and the Bellman equations."""
