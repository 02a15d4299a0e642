"""The suite's two tiers: `make test` runs the core tier (every code path once), `make sweeps` the cases
marked ``sweep`` (further configurations of a path a core case already covers; pyproject.toml)."""

import pytest


def tiered(cases, ids, core):
    """``cases`` (tuples of argument values) as ``pytest.param`` under their ``ids``: those named in
    ``core`` stay in the core tier, every other is marked ``sweep``. A name in ``core`` that is no case's
    id fails at collection, so a renamed case cannot drop out of the core tier unnoticed."""
    ids = list(ids)
    unknown = set(core) - set(ids)
    assert not unknown, f"core cases that are no case's id: {sorted(unknown)}"
    return [
        pytest.param(*case, id=name, marks=() if name in core else pytest.mark.sweep)
        for case, name in zip(cases, ids, strict=True)
    ]
