"""The build backend of pyproject.toml: it refuses `pip install .` and `pip install -e .` with one
line, since the project runs from its clone (see that file)."""
import sys

MESSAGE = ("error: this project is not installed with pip: its packages (config, data, models, ...) "
           "would shadow modules of your own; run it from its clone, and from another folder put the "
           "clone on PYTHONPATH (README.md, \"From your own program\")")


def refuse(*args, **kwargs):
    sys.exit(MESSAGE)


build_wheel = build_sdist = build_editable = refuse
