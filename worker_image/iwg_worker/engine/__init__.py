"""The continuous-batching generation engine a ``generate`` worker runs (transformers' paged engine inside)."""
