"""The parts of detached PPO that need no Ray: the PPO math (algo), models and generation,
the experience maker, the learner and its strategies, weight buckets and checkpoint files.
Everything here imports and tests without Ray (tests/unit/test_imports.py checks it)."""
