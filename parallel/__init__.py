"""Process setup shared by `ckpt` and `trainer`: devices, process groups, megatron's parallel
state, CPU mode and the model wrappers (DDP, bf16). Imports nothing of `trainer` or `ckpt`."""
