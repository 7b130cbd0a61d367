"""What engine, inference and the entry scripts all stand on: the launch environment (`launch_env`),
the collectives and the process group (`distributed`), checkpoint files (`checkpoint`). It imports
neither engine nor inference."""
