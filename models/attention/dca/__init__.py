"""Dual Chunk Attention (SPEC.md), exact for training.

    attention.py  `dual_chunk_attention`: the function, its autograd forward
    plan.py       `DCAPlan` (documents, positions, RoPE tables) and the argument checks
    calls.py      the dense kernel calls of one document
    backward.py   the global-LSE backward in bounded calls
    grouped.py    small FA4 problems: the parts as one block-sparse call each way
    graphs.py     forward and backward replayed as CUDA graphs (opt-in)
    scaling.py    length-dependent logit scaling (log, yarn)
    module.py     `DCACoreAttention`, the megatron core-attention module

The CP form lives with the other variants' in ../cp_variants.py. Nothing is imported here, so
`models.attention.dca.scaling` (read by the config) does not load the kernels.
"""
