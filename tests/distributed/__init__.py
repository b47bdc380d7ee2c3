"""Multi-rank tests on persistent gloo worker pools."""
