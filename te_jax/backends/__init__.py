"""Attention backends (pallas, cudnn, xla) and the selection that explains itself."""
