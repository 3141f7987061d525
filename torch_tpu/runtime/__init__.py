"""The executor: how lowered programs run (modes), and what was counted while they ran."""
