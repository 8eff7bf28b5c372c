"""flashattn.layers — modules of ``flash_attn.layers`` (rotary embedding)."""
