"""Multi-turn (agentic) rollouts: tool-call parsing, tools and the sandbox, environments, the turn loop."""
