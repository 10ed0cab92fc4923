"""Starting replicas: the tolerant local launcher, one torchrun job per replica, the coordinator process."""

from lightning_recover.launch.supervisor import supervise

__all__ = ["supervise"]
