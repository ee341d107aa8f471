"""The trainer side: strategies, the PPO learner, and the Ray Train loop with what it uses per step
(metrics, collectives, the makers' monitor)."""
