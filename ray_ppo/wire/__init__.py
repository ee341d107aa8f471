"""What crosses processes: the typed messages between roles, experience chunks in transport, and
items packed flat in NumPy. Nothing here imports torch at module level."""
