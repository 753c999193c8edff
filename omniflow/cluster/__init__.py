"""Roles placed off the front: worker processes (``placement="process"``, ``Deploy``) and Ray
actors (``Ray``). The front's router and fleet, the workers, the fast path between them and the
launchers live here; the runtime sees them only through ``runtime._executor`` (this package
registers itself there on import)."""

from omniflow.cluster._place import Placement
from omniflow.cluster._placement import Deploy
from omniflow.cluster._ray_plan import Ray
from omniflow.runtime._executor import register_cluster

register_cluster(Placement())

__all__ = ["Deploy", "Ray"]
