"""Attention variants: pure functional cores ([batch, seq, heads, dim] in and out) and thin
megatron core-attention modules around them."""
