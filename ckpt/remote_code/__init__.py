"""The transformers remote code `python -m ckpt export-hf` copies into DCA, chunked and head-gated
exports (configuration_longctx.py, modeling_longctx.py, longctx_attention.py); trainer.generate
uses longctx_attention.py for its cached decoding steps."""
