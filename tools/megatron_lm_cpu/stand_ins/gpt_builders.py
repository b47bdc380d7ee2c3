"""Stand-in for Megatron-LM's top-level ``gpt_builders.py`` (used only when the Megatron-LM tree lacks
it): builds megatron-core's ``GPTModel`` from Megatron-LM's arguments for the dense local layer spec
(``--transformer-impl local``), as Megatron-LM's ``gpt_builder`` does on that path. Every other path
(legacy models, ``--spec``, Transformer Engine, MoE, MTP, heterogeneous or experimental layers, YAML
configs) is refused rather than approximated."""
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import print_rank_0
from megatron.training.arguments import core_transformer_config_from_args


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    print_rank_0('building GPT model (stand-in gpt_builder, local spec) ...')
    unsupported = {
        "--use-legacy-models": args.use_legacy_models, "--spec": args.spec,
        "--yaml-cfg": getattr(args, "yaml_cfg", None), "--num-experts": args.num_experts,
        "--mtp-num-layers": getattr(args, "mtp_num_layers", None),
        "--transformer-impl != local": args.transformer_impl != "local",
        "--heterogeneous-layers-config-path": getattr(args, "heterogeneous_layers_config_path", None),
        "--experimental-attention-variant": getattr(args, "experimental_attention_variant", None),
    }
    refused = [flag for flag, value in unsupported.items() if value]
    if refused:
        raise NotImplementedError(f"stand-in gpt_builder: unsupported {refused}")
    if config is None:
        config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(
        num_experts=None, qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention,
        normalization=args.normalization, qk_l2_norm=args.qk_l2_norm, use_kitchen=config.use_kitchen)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
        pg_collection=pg_collection)
