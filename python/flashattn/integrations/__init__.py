"""flashattn.integrations — attention backends for other libraries (transformers)."""
