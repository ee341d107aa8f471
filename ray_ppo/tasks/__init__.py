"""Built-in tasks with verifiable rule rewards."""
