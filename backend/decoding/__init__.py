"""Decoding: speculative sampling."""
