"""chunk."""
