"""The planner: the byte, memory and makespan models the live runs check, at real scale (models, clusters, one plan,
the search, published rows)."""
