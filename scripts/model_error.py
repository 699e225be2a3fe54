"""The memory model against XLA on every plan of a fixed set, per test-corpus model.

For each model of tests/corpus.py, the plans of tests/error_plans.py (the plan that
stores everything, the plan that checkpoints every stage but the last, each built-in
keep rule per block, and the solver's plans at 0, 25, 50, 75 and 95% of the way from the
model's smallest feasible budget to its no-remat peak; tests/test_corpus.py checks the
same rows). Each is compiled (XLA's peak of the donated optax step) and compared with
the model's peak:
"raw" is the model without the calibration (no scales, no offset), "fitted" the model
`rp.plan` uses. Prints one line per plan, then per model and over all plans the median
and largest error and how many plans are within 3%. Run from the repository root:

    python scripts/model_error.py [MODEL ...]

Several minutes for the whole corpus on 2 CPU cores (its first ten models, hf_gpt2 to
resnet_maxpool: about 4).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402
from error_plans import TOLERANCE, measure  # noqa: E402


def report(name: str) -> list[tuple[float, float]]:
    t0 = time.perf_counter()
    fitted, rows = measure(name)
    print(f"## {name}: residual_scale {fitted.residual_scale:.2f}, workspace_scale "
          f"{fitted.workspace_scale:.2f}")
    for row in rows:
        print(f"  {row.label:10s} XLA {row.xla_bytes:>12,d} B   raw {row.raw:+7.2%}   "
              f"fitted {row.fitted:+7.2%}")
    errors = [(row.raw, row.fitted) for row in rows]
    summary(errors)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return errors


def summary(rows: list[tuple[float, float]], indent: str = "  ") -> None:
    for k, label in ((0, "raw"), (1, "fitted")):
        e = [abs(r[k]) for r in rows]
        print(f"{indent}{label}: median {statistics.median(e):.2%}, max {max(e):.2%}, "
              f"within 3%: {sum(x <= TOLERANCE for x in e)} of {len(e)}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"corpus models (default: all): {', '.join(sorted(corpus.MODELS))}")
    models = parser.parse_args().models
    unknown = [m for m in models if m not in corpus.MODELS]
    if unknown:
        parser.error(f"unknown corpus model {unknown[0]!r}; known: "
                     f"{', '.join(sorted(corpus.MODELS))}")
    every = []
    for model in models or corpus.MODELS:
        every += report(model)
    print(f"all {len(every)} plans:")
    summary(every)
