"""torch.distributed plumbing: spawning ranks, ports, and (later) collectives built on send/recv."""
