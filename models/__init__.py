"""GPT models with long-context attention variants, built on megatron-core via ModuleSpec."""
