"""wrapper."""
