"""``python -m megatron_opt_train`` (under torchrun: ``torchrun ... -m megatron_opt_train``): the main job."""
from megatron_opt_train.train import main

main()
