"""The DiT, its checkpoint format, text conditioning and the flow-matching sampler (plain torch)."""
