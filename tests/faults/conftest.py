"""Fixtures of the fault-injection suite; the helpers live in faultkit.py."""

from faultkit import fault_baseline, fault_outcomes, pytest_configure  # noqa: F401
