"""Strategy presets that take their settings from YAML, and the checks run before any process group.

    fsdp.py       FSDP2Strategy (fully_shard per block over gloo or NCCL), FSDPStrategy (Lightning's FSDP1)
    deepspeed.py  DeepSpeedStrategy: Lightning's, on CPU processes too
    checks.py     what a run's strategy needs, checked before any process starts; its defaults (precision)
"""
