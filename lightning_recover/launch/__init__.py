"""Starting replicas: the tolerant local launcher, one torchrun job per replica, the coordinator process."""

from lightning_recover.launch.launcher import supervise

__all__ = ["supervise"]
