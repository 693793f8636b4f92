"""Removes what node agents killed before their own teardown left behind: python -m tests.nodeagent.cleanup"""

from tests.nodeagent.network import sweep_stale_agents

if __name__ == "__main__":
    removed = sweep_stale_agents()
    print(f"removed the networks of {len(removed)} stale node agent(s): {', '.join(removed) or '-'}")
