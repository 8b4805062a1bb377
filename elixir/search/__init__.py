"""Plans and the searches that produce them. Nothing here touches a device."""

from elixir.plan import ChunkPlan, Placement, Prediction, SearchResult, Sharding
from elixir.search.cost_model import MemoryPolicy
from elixir.search.minimum_waste import minimum_waste_search, print_plan
from elixir.search.optimal import DoesNotFitError, optimal_search

__all__ = ["Sharding", "ChunkPlan", "Placement", "Prediction", "SearchResult", "minimum_waste_search", "print_plan"]
__all__ += ["DoesNotFitError", "MemoryPolicy", "optimal_search"]
