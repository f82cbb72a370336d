"""Hydra-configured megatron-core trainer for long-context GPT models."""
