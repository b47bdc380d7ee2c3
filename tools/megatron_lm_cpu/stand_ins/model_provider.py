"""Stand-in for Megatron-LM's top-level ``model_provider.py`` (used only when the Megatron-LM tree lacks
it): ``pretrain_gpt.py`` passes ``partial(model_provider, gpt_builder)`` to ``pretrain``, and the
provider hands its arguments to the builder. Megatron-LM's memory-history and ModelOpt branches are
not reproduced (off by default)."""


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    from megatron.training import get_args
    args = get_args()
    if args.record_memory_history or getattr(args, "modelopt_enabled", False):
        raise NotImplementedError("stand-in model_provider: --record-memory-history / ModelOpt unsupported")
    return model_builder(args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)
