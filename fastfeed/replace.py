"""Building ``fastfeed.DataLoader`` where code asks for ``torch.utils.data.DataLoader``: the mechanism behind
``fastfeed run`` and the doctor's "with fastfeed's loader" what-if.

A reversible patch on torch's ``DataLoader.__init__`` switches the object being built to fastfeed's class before
anything is set on it, then builds it with fastfeed's ``__init__`` and the same arguments. So every spelling works:
``from torch.utils.data import DataLoader`` done anywhere and at any time, module-level aliases, and subclasses.
A library's subclass becomes a class deriving from it and from fastfeed's loader (its own methods first), unless it
replaces torch's iterator machinery (``_get_iterator``): fastfeed's ring would then be bypassed or broken, so it is
left as it is, with a note. ``FASTFEED_RUN_EXCLUDE=module.Class,...`` leaves the named classes alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from torch.utils.data import DataLoader as TorchLoader

from .loader import DataLoader as FastLoader

EXCLUDE_ENV = "FASTFEED_RUN_EXCLUDE"
UNSAFE = ("_get_iterator",)  # torch's iterator factory: a subclass that replaces it never reaches fastfeed's ring
_MISSING = object()


@dataclass
class Made:
    """One loader built while the patch was in place."""

    where: str  # file:line of the code that built it
    cls: str  # the class it asked for
    replaced: bool
    why: str = ""  # why it was left as it was


def excluded() -> set[str]:
    return {name.strip() for name in os.environ.get(EXCLUDE_ENV, "").split(",") if name.strip()}


def target(cls: type, exclude: set[str] | None = None) -> tuple[type | None, str]:
    """The class an object of ``cls`` becomes, or None and why it stays ``cls``."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if issubclass(cls, FastLoader):
        return None, "already fastfeed's"
    if name in (excluded() if exclude is None else exclude):
        return None, f"excluded by {EXCLUDE_ENV}"
    if cls is TorchLoader:
        return FastLoader, ""
    unsafe = [attr for attr in UNSAFE for k in cls.__mro__[: cls.__mro__.index(TorchLoader)] if attr in vars(k)]
    if unsafe:
        return None, f"it overrides {unsafe[0]}, torch's iterator machinery"
    return _mixed(cls), ""


_MIXED: dict[type, type] = {}


def _mixed(cls: type) -> type:
    """``cls`` on top of fastfeed's loader: the subclass's own methods first, then fastfeed's, then torch's."""
    mixed = _MIXED.get(cls)
    if mixed is None:
        mixed = _MIXED[cls] = type(cls.__name__, (cls, FastLoader), {"__module__": cls.__module__,
                                                                      "__qualname__": cls.__qualname__})  # fmt: skip
    return mixed


def caller(loader) -> str:
    """file:line of the innermost frame outside torch, fastfeed and ``loader``'s own methods (a subclass's
    ``__init__``): where the loader was asked for. A script run as ``__main__`` (fastfeed's own demo included)
    counts as the user's."""
    frame = sys._getframe(1)
    while frame is not None and (str(frame.f_globals.get("__name__")).startswith(("torch.", "fastfeed."))
                                 or frame.f_locals.get("self") is loader):  # fmt: skip
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class Replacer:
    """The patch: ``install()`` it, ``close()`` to restore torch's ``__init__``; ``made`` lists what was built."""

    def __init__(self) -> None:
        self.made: list[Made] = []
        self._saved = _MISSING
        self._exclude = excluded()

    def install(self) -> Replacer:
        self._saved = TorchLoader.__dict__["__init__"]
        original, replacer = self._saved, self

        def __init__(loader, *args, **kwargs):
            if isinstance(loader, FastLoader):  # fastfeed's __init__ reaching torch's
                return original(loader, *args, **kwargs)
            new, why = target(type(loader), replacer._exclude)
            replacer.made.append(Made(caller(loader), f"{type(loader).__module__}.{type(loader).__qualname__}",
                                      new is not None, why))  # fmt: skip
            if new is None:
                return original(loader, *args, **kwargs)
            loader.__class__ = new
            return FastLoader.__init__(loader, *args, **kwargs)

        __init__.__wrapped__ = original
        TorchLoader.__init__ = __init__
        return self

    def close(self) -> None:
        if self._saved is not _MISSING:
            TorchLoader.__init__ = self._saved
            self._saved = _MISSING

    def summary(self) -> str:
        """One line: how many loaders were replaced and where they were made, and any left alone and why."""
        done = [m for m in self.made if m.replaced]
        line = f"fastfeed run: {len(done)} of {len(self.made)} DataLoader(s) replaced by fastfeed's"
        if done:
            line += " (made at " + ", ".join(sorted({m.where for m in done})) + ")"
        left = [m for m in self.made if not m.replaced]
        if left:
            line += "; left as they were: " + ", ".join(sorted({f"{m.cls} at {m.where} ({m.why})" for m in left}))
        return line
