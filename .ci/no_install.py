"""pyproject.toml's build backend: `pip install .` and `pip install -e .` stop with one line, since the
project runs from its clone (see that file)."""
import sys


def refuse(*args, **kwargs):
    sys.exit("error: this project is not installed with pip: its packages (config, data, models, ...) would "
             "shadow modules of your own; run it from its clone, and from another folder put the clone on "
             "PYTHONPATH (README.md, \"From your own program\")")


build_wheel = build_sdist = build_editable = refuse
