"""Megatron-LM integration: megatron-core's config objects and call shapes, and ``install()``."""
