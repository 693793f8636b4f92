"""Model runners behind the torch worker: one module per task."""
