"""Plans and the searches that produce them. Nothing here touches a device."""

from elixir.search.plan import ChunkPlan, Placement, Prediction, SearchResult

__all__ = ["ChunkPlan", "Placement", "Prediction", "SearchResult"]
