"""Every test process gets 8 simulated CPU devices, for the sharded-step tests
(tests/test_sharding.py). XLA reads the flag when JAX's backend starts, so it is set
here, before any test module imports jax. Unsharded steps still run on device 0; the
extra host devices cost nothing measurable (see docs/guide.md, "Sharded steps")."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
