"""The collective save and load engine: inventory, planning, staging, and the
save/load pipelines every entry point runs on.
"""

from .inventory import (
    LocalPieces,
    Piece,
    Route,
    Serialized,
    Targets,
    ValueAdapter,
    adapted_for_load,
    adapted_for_save,
    adapter_of,
    held_adapted,
    is_plain_tensor,
    register_route,
    register_value_adapter,
    require_same_adapted,
    route_named,
    route_of,
    routes,
    serialize_objects,
)
from .load import item_reads, load_state
from .plan import SaveRecords, first_hole, holes_in_plans, kind_disagreements, region
from .read_once import Ask, ItemRoute, arrived, may_pay, routed_plans, run_item_route
from .save import SaveReport, Staging, save_state
from .staging import Staged, Stager
from .stored import StoredView, read_records

__all__ = [
    "Ask",
    "ItemRoute",
    "LocalPieces",
    "Piece",
    "Route",
    "SaveRecords",
    "SaveReport",
    "Serialized",
    "Staged",
    "Stager",
    "Staging",
    "StoredView",
    "Targets",
    "ValueAdapter",
    "adapted_for_load",
    "adapter_of",
    "adapted_for_save",
    "arrived",
    "first_hole",
    "held_adapted",
    "holes_in_plans",
    "is_plain_tensor",
    "item_reads",
    "kind_disagreements",
    "load_state",
    "may_pay",
    "read_records",
    "region",
    "register_route",
    "register_value_adapter",
    "require_same_adapted",
    "route_named",
    "route_of",
    "routed_plans",
    "routes",
    "run_item_route",
    "save_state",
    "serialize_objects",
]
