"""Known-bug clusters: the model, its loaders (JSON, JSON Lines, markdown reports)."""

from bot.clusters.models import Cluster, Member

__all__ = ["Cluster", "Member"]
