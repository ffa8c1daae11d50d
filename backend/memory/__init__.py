"""GPU memory hierarchy presets, roofline arithmetic, and probes of this machine."""
