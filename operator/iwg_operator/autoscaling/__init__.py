"""Autoscaling replicas from the driver's metrics (HPA formula, tolerance, stabilization windows)."""
