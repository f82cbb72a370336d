"""Tests of the model code: attention cores, specs, the model factory."""
