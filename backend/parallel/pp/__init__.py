"""Pipeline parallelism: a schedule IR (schedules.py), one executor for every schedule (executor.py)."""
