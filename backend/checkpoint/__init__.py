"""Fault tolerance with real checkpoints: DCP saves and loads (checkpointer, pieces), the mesh's state in them and its
runs with a kill, a restart and a continuation on another mesh (mesh_state, mesh_run), and what those runs check
(mesh_checks)."""
