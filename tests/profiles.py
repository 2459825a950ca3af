"""Hypothesis profiles: the test run is deterministic, fuzzing is a separate run.

`scripts/test` (CI) uses the "ci" profile: derandomized (each property draws the
same cases every run, from a seed derived from the test itself), no example
database and no reproduction blobs, so a run never depends on a .hypothesis/
directory left by an earlier one. Every case a fuzz run ever found is kept in the
tests as an explicit @example, so CI replays it for ever.

`scripts/fuzz` uses the "fuzz" profile: random seeds and many more examples, with
the database on so a failure it finds replays at the next fuzz run until it is
written down as an @example. The profile is chosen by THINBLOCK_HYPOTHESIS_PROFILE
(or hypothesis's own --hypothesis-profile option, which wins).
"""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILE_VARIABLE = "THINBLOCK_HYPOTHESIS_PROFILE"
# Per property in a fuzz run (a test's own count is the floor).
FUZZ_EXAMPLES = int(os.environ.get("THINBLOCK_FUZZ_EXAMPLES", "5000"))


def register() -> None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=False, deadline=None)
    settings.register_profile(
        "fuzz",
        derandomize=False,
        database=DirectoryBasedExampleDatabase(".hypothesis/fuzz"),
        print_blob=True,
        deadline=None,
        max_examples=FUZZ_EXAMPLES,
    )
    settings.load_profile(os.environ.get(PROFILE_VARIABLE, "ci"))


def examples(n: int) -> int:
    """A property's example count: n in CI, the fuzz profile's count (if larger) when
    fuzzing. Explicit counts in @settings would otherwise override the profile."""
    current = settings.default
    assert current is not None  # register() has loaded a profile
    return n if current.derandomize else max(n, current.max_examples)
