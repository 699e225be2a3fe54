"""Every test process gets 8 simulated CPU devices, for the sharded-step tests
(tests/test_sharding.py). XLA reads the flag when JAX's backend starts, so it is set
here, before any test module imports jax. Unsharded steps still run on device 0; the
extra host devices cost nothing measurable (see docs/guide.md, "Sharded steps")."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


# The longest files first: `pytest -n 2 --dist loadfile` hands whole files to the two
# workers in collection order, so a long file collected last would run alone at the end
# (measured: the reliability sweep, collected last, ran ~10 minutes on one worker).
_LONGEST_FIRST = ("test_sweep.py", "test_sweep_b.py", "test_reliability.py", "test_nonchain.py",
                  "test_frontier.py", "test_models.py", "test_sharding.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within files
