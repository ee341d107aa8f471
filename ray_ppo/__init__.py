"""ray_ppo: detached PPO for language models on Ray.

Importing the package is cheap: it pulls in neither Ray nor torch. Import the parts you need
(`ray_ppo.algo`, `ray_ppo.models`, `ray_ppo.api`, ...).
"""

__version__ = "0.1.0"
