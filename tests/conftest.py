"""Settings every test module shares: hypothesis profiles, and the import layout of a mutmut run."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings

# `make test` and CI run the same examples every time (a failure there is a regression, not luck); a local
# `HYPOTHESIS_PROFILE=long make test` explores ~12x more random examples to find new bugs.
settings.register_profile(
    "ci", derandomize=True, max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", derandomize=False, max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Mutation testing runs every surviving mutant through the stateful tests: fewer examples, still derandomized.
settings.register_profile(
    "mutation", derandomize=True, max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# Under mutmut (scripts/mutation.py) the tests run in build/mutation/<target>/mutants/, on the mutated copy.
_UNDER_MUTMUT = Path(__file__).resolve().parent.parent.name == "mutants"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mutation" if _UNDER_MUTMUT else "ci"))
