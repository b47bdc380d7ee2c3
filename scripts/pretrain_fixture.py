"""A small dataset in Megatron-LM's formats for the main job's data block: ``python scripts/pretrain_fixture.py
OUT_DIR`` (megatron_opt_train.fixture; needs megatron-core and numpy)."""
from megatron_opt_train.fixture import main

if __name__ == "__main__":
    main()
