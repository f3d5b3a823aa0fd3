"""The RL loop and the start-up shared by the launchers."""
