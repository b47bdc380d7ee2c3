"""Optimizer state and its checkpoints: the store of masters and rule state (``shard_store``), its pieces
and their reads and writes (``piece_state``), the protocol checkpoints read it through (``view``), the
in-memory ``state_dict()`` (``in_memory``), Megatron-LM's torch_dist format (``torch_dist``,
``torch_dist_layouts``) and the index math both formats share (``boxes``)."""
