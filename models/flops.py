"""Model FLOPs and MFU accounting, next to the model (torchtitan style).

Counts matmul FLOPs of one training step (forward + backward = 3x forward; recomputation is not
counted: MFU measures useful work). Attention scores count causal attention's S^2/2 per head for
every variant, as the benchmarks do: DCA performs exactly those FLOPs, chunked attention fewer
(its figure is then an upper bound on useful work, said so where reported).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak (TFLOP/s) by device-name substring, first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 125.0),
)


def training_flops_per_sequence(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                                num_query_groups: int, kv_channels: int, ffn_hidden_size: int,
                                swiglu: bool, vocab_size: int, seq_length: int,
                                head_wise_gate: bool = False) -> float:
    """Matmul FLOPs to train on one sequence of `seq_length` tokens (forward + backward)."""
    h, s = hidden_size, seq_length
    q_dim = num_attention_heads * kv_channels
    kv_dim = num_query_groups * kv_channels
    qkv_out = q_dim + 2 * kv_dim + (num_attention_heads if head_wise_gate else 0)
    projections = 2 * s * h * qkv_out + 2 * s * q_dim * h  # linear_qkv + linear_proj
    # QK^T and PV over the causal half: 2 matmuls x 2 FLOPs x (s^2 / 2) x heads x head dim.
    attention = 2 * 2 * (s * s / 2) * num_attention_heads * kv_channels
    mlp = 2 * s * h * ffn_hidden_size * (3 if swiglu else 2)
    logits = 2 * s * h * vocab_size
    forward = num_layers * (projections + attention + mlp) + logits
    return 3.0 * forward


def peak_tflops(device: torch.device) -> float | None:
    """bf16 dense peak of the device, or None (CPU, unknown GPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None
