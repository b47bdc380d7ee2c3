"""The main job's entry point: ``torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py [flags]``
(Megatron-LM's flags; ``--help`` lists them). The application is the megatron_opt_train package
(installed with megatron_opt: ``pip install -e .``); docs/pretrain.md."""
from megatron_opt_train.train import main

if __name__ == "__main__":
    main()
