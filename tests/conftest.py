"""Every test process gets 8 simulated CPU devices, for the sharded-step tests
(tests/test_sharding.py). XLA reads the flag when JAX's backend starts, so it is set
here, before any test module imports jax. Unsharded steps still run on device 0; the
extra host devices cost nothing measurable (see docs/guide.md, "Sharded steps").

Compiles are kept in JAX's persistent compilation cache under .pytest_cache/ (ignored by
git), shared by the xdist workers, the CLI subprocesses the tests start (they inherit the
environment) and the quick and slow parts of a CI run. Many tests compile the same step
or stage; a cache hit gives the same executable, so `memory_analysis`, cost analysis and
the optimized HLO text the planner reads are unchanged (measured: a CLI plan of
configs/gpt2-tiny.yaml, 26 s cold, 14 s warm). Every distinct program is still compiled
once per clean checkout. REMAT_TEST_COMPILE_CACHE=0 turns it off; a
JAX_COMPILATION_CACHE_DIR already set is kept."""

import os
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count=8"

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

if os.environ.get("REMAT_TEST_COMPILE_CACHE", "1") != "0":
    _CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compiles"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
    # every compile, however quick or small (the defaults skip those under 1 s)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# The longest files first: `pytest -n 2 --dist loadfile` hands whole files to the two
# workers in collection order, so a long file collected last would run alone at the end
# (measured: the reliability sweep, collected last, ran ~10 minutes on one worker). Order
# by the slow part's time per file (measured at b2f479d, seconds of test time: corpus
# 1,668, split since into test_corpus.py ~906 and test_corpus_b.py ~761, sweep_b 555,
# sweep 419, sharding 402, scan 203, models 168, frontier 139, pipeline 127, closed_loop
# 124, nonchain 98); the files not named follow.
_LONGEST_FIRST = ("test_corpus.py", "test_corpus_b.py", "test_sweep_b.py", "test_sweep.py",
                  "test_sharding.py", "test_scan.py", "test_models.py", "test_frontier.py",
                  "test_pipeline.py", "test_closed_loop.py", "test_nonchain.py",
                  "test_closed_loop_recovery.py", "test_reliability.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within files
