"""Runtime services: processes and meshes, sharding rules, checkpoints, metrics."""
