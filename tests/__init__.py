"""The test suite as a package: helpers import as ``tests.support.<module>``, cases as ``tests.<folder>.<module>``."""
