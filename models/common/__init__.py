"""Building blocks shared by every model family (norms, the attention backend)."""
