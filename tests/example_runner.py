"""Run the shipped example (examples/own_training_loop.py) as a test would import it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/own_training_loop.py"


def run_example(steps: int, name: str = "own_training_loop") -> dict:
    """Import the example under module name `name` and return `main(steps=steps)`."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Flax modules are dataclasses: they look themselves up
    try:
        spec.loader.exec_module(module)
        return module.main(steps=steps)
    finally:
        sys.modules.pop(spec.name, None)
