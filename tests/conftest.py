"""Test set-up. JAX's simulated CPU devices must be requested before JAX starts, so this runs
first: 4 devices cover the world sizes 2, 3 and 4 the tests use."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.env import simulate_host_devices  # noqa: E402

simulate_host_devices(4)
# The suite's JAX runs use 2-4 devices: on a machine with fewer GPUs than that, "auto" would pick
# the GPU and fail. Tests run JAX on the simulated CPU devices unless asked otherwise.
os.environ.setdefault("JAX_PLATFORMS", os.environ.get("PARALLEL_TWINS_TEST_JAX_PLATFORMS", "cpu"))
