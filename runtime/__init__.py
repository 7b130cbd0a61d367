"""What engine, inference and the entry scripts stand on: the launch environment, the process group,
checkpoint files."""
