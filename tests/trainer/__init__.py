"""Tests of the training loop, data, evaluation and the Hydra entry points."""
