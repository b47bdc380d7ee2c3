"""Helpers shared by the test folders (models, harnesses, recorded configs)."""
