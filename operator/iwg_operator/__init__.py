"""iwg operator: reconciles InferenceWorkerGroups into GPU-scheduled worker pods. Never imports torch."""
