"""Self-healing: a deep prober per worker, failure counting, pod or replica replacement within a budget."""
