"""Tests of the checkpoint format and `python -m ckpt`."""
