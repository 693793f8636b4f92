"""iwg worker runtime: the process, wrapper and worker layers, executors and the group driver."""
