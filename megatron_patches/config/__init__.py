"""Every TransformerConfig field classified for prefix reuse."""
