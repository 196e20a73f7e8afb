"""The offload runtime: a memory plan for a GPU budget, the host expert store, the device expert cache and its
residency table, routing hooks and the offloading modes.

    from specter_gguf.engine import Model
    m = Model.load("model.gguf", device="cuda", gpu_budget="16GiB", offload="lru")
    g = m.generate("Hello", n_predict=64).wait(); print(g.stats.to_dict())
"""

from specter_gguf.runtime.budget import MemoryPlan, plan_memory
from specter_gguf.runtime.cache import POLICIES, ExpertCache
from specter_gguf.runtime.metrics import OffloadCounters
from specter_gguf.runtime.offload import MODES, OffloadedExperts, OffloadRuntime, load_offloaded
from specter_gguf.runtime.routing import DeviceRoutingCounts, RoutingProfile
from specter_gguf.runtime.store import ExpertStore

__all__ = ["MemoryPlan", "plan_memory", "POLICIES", "ExpertCache", "OffloadCounters",
           "MODES", "OffloadedExperts", "OffloadRuntime", "load_offloaded", "DeviceRoutingCounts",
           "RoutingProfile", "ExpertStore"]
