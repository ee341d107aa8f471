"""A run's files: its directory (``rundir``), the writers every run uses (``writers``, ``tracking``),
JSON Lines, samples, evaluation records, plots and the failure report."""
