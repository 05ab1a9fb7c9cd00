"""Shared fixtures live in fixtures_*.py modules next to this file, one per area."""

import importlib.util
from pathlib import Path

_here = Path(__file__).parent
pytest_plugins = [p.stem for p in sorted(_here.glob("fixtures_*.py"))]
assert importlib.util.find_spec("hsextract") is not None, "install the package: see README"
