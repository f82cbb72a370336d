"""Dual Chunk Attention (An et al. 2024; the part table in attention.py), exact for training.

    attention.py  `dual_chunk_attention`: the function, its autograd forward
    plan.py       `DCAPlan` (documents, positions, RoPE tables) and the argument checks
    calls.py      the dense kernel calls of one document
    backward.py   the global-LSE backward in bounded calls
    grouped.py    under FA4: which path runs (`paths`), and the passes through DCA's kernels,
                  the backward in pieces
    fa4_forward.py   DCA's forward kernel: FA4's SM90 causal forward, Q reloaded per part
    fa4_backward.py  DCA's backward kernel: FA4's SM90 causal backward, Q chosen per part
    fa4_parts.py  what the two kernels share: the part rule, the compile cache
    dq_parts.py   the parts' dQ accumulators rotated back and summed into dq in one pass
    graphs.py     forward and backward replayed as CUDA graphs (opt-in)
    scaling.py    length-dependent logit scaling (log, yarn)
    module.py     `DCACoreAttention`, the megatron core-attention module

The CP form lives with the other variants' in ../cp_variants.py. Nothing is imported here: the
config's checks (`scaling.py`, `plan.check_backward`) load no kernel module
(tests/test_architecture.py).
"""
