"""Hypothesis settings of the fuzz tests (tests/fuzz/): the readers' generated inputs.

Two sizes, one profile name (``tetrarec-fuzz``), chosen by the environment:

- ``make test``: a few hundred examples per test, derandomized (the same inputs on
  every run, so a failure in CI is a failure on a laptop), the whole folder in about a
  minute on two cores;
- the deep run, ``make fuzz`` (``TETRAREC_FUZZ_EXAMPLES=10000``): that many examples per
  test, drawn afresh on each run (a scheduled run explores new inputs; a failure prints
  the ``@reproduce_failure`` blob that replays it).

Every example also has a deadline: a reader that hangs on an input fails that example
(and pytest-timeout ends a real hang: ``timeout`` in pyproject, ``make fuzz`` raises it
for the long run).
"""

from __future__ import annotations

import os
from datetime import timedelta

from hypothesis import HealthCheck, Phase, settings

DEEP_EXAMPLES = int(os.environ.get("TETRAREC_FUZZ_EXAMPLES", "0") or 0)

settings.register_profile(
    "tetrarec-fuzz",
    max_examples=DEEP_EXAMPLES or 200,
    derandomize=not DEEP_EXAMPLES,
    database=None,
    # A parse of these few-line inputs takes milliseconds; 10 s is a hang, not load.
    deadline=timedelta(seconds=10),
    print_blob=True,
    # No "explain" phase: it reruns a failure hundreds of times to list the lines only
    # failing examples ran (tens of seconds here); the failing example is printed anyway.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # tmp_path: each example overwrites its files
    ],
)
