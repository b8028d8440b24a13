"""What runs when a ``fastfeed.DataLoader`` is made, registered by the integrations that need to know.

The loader calls :func:`loader_made` and knows nothing else: an integration (``fastfeed.accelerate``'s watcher)
registers itself here, so it depends on the loader and the loader on none of them.
"""

from __future__ import annotations

from typing import Any, Callable

_on_made: list[Callable[[Any], None]] = []


def on_loader_made(callback: Callable[[Any], None]) -> None:
    """Call ``callback(loader)`` for every ``fastfeed.DataLoader`` constructed from now on (once per callback)."""
    if callback not in _on_made:
        _on_made.append(callback)


def loader_made(loader: Any) -> None:
    """Run every registered callback on a loader just constructed, in the order they were registered."""
    for callback in tuple(_on_made):
        callback(loader)
