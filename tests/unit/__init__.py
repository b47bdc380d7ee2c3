"""Single-process pure-logic tests (no megatron-core)."""
