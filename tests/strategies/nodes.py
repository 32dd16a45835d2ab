"""A stand-in for the one Grid method a strategy's sampling calls."""

from collections.abc import Iterable


class Nodes:
    """The connected node ids, as ``Grid.get_node_ids`` returns them."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return self.node_ids
