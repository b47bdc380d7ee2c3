"""Checkpoint save/load tests, including kills in the middle of a save."""
