"""The trainer: the Ray Train loop (``loop``, the role's one Ray module), the PPO learner, the
strategies (DDP, FSDP2, ColossalAI), collectives, weight publishing, the makers' monitor and
checkpoint files."""
