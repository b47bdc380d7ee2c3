"""Tests against an installed megatron-core (CI runs them on Python 3.11 and 3.12)."""
