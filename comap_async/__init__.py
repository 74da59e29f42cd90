"""comap-async shared core: config, protocol, prompts, gates, facts, models, envs, inference, cli.

The core never imports a process package (actors, broker, learner).
"""

__version__ = "0.1.0"
