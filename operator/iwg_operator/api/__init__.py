"""The InferenceWorkerGroup API: pydantic models (the single source of the CRD) and the pod wiring contract.

Imported by the operator, the driver, `iwg serve` and the worker runtime; it must stay free of kopf and torch.
"""
