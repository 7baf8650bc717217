"""A :class:`~inferscale.memory.Memory` pickles as its settings, as a database client pickles
as its URL: unpickled in-process it is the very Memory pickled while that is open, else an
open Memory over the same store, else the store opened anew (another process)."""

from __future__ import annotations

import os
import uuid
import weakref
from pathlib import Path
from typing import Any

#: the memories open in this process, by a handle unique to each (:meth:`Reopenable.__reduce__`)
_OPEN: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
# a forked child's memories are not its parent's: one unpickled there opens the store anew
# (and is refused, naming the parent, while the parent holds it: inferscale.store.open_lock)
os.register_at_fork(after_in_child=_OPEN.clear)


def reopen(cls: type, settings: dict, handle: str | None = None) -> Any:
    """What an unpickled :class:`~inferscale.memory.Memory` is: the very Memory that was
    pickled when it is open in this process; else an open Memory of this process over the
    same store (the same ``data_dir`` and ``chroma_url``); else a new one opened with
    ``settings``.

    Args:
        cls: the class pickled (:class:`~inferscale.memory.Memory`). settings: the
            constructor's settings. handle: the pickled Memory's (a uuid).

    Raises:
        As :class:`~inferscale.memory.Memory`'s constructor, when a new one is opened.
    """
    same = _OPEN.get(handle) if handle else None
    if same is not None and not same._closed:
        return same
    data_dir = Path(settings["data_dir"]).resolve()
    for memory in list(_OPEN.values()):
        if (not memory._closed and memory.config.data_dir.resolve() == data_dir
                and memory.config.chroma_url == settings.get("chroma_url")):
            return memory
    return cls(**settings)


class Reopenable:
    """The pickling half of :class:`~inferscale.memory.Memory` (not used on its own)."""

    def _register_open(self) -> None:
        """Note this (opened) memory as open in this process, under a handle of its own."""
        self._handle = uuid.uuid4().hex
        _OPEN[self._handle] = self

    def __reduce__(self) -> tuple:
        """A Memory pickles as its settings, as a database client pickles as its URL: unpickled
        in a process where a Memory over the same store is open, it is that Memory; elsewhere
        it opens the store anew with the same settings (:func:`reopen`). So a LangChain or
        LlamaIndex object holding a Memory can be pickled, deep-copied or sent to a worker
        process. In-process it is the pickled Memory itself while that is open. The settings
        are those given to the constructor (``INFERSCALE_*`` variables
        are read again where it is opened), with ``data_dir`` made absolute; a custom
        ``engine``, ``extractor`` or ``reconciler`` is not carried."""
        settings = self.config.model_dump(exclude_unset=True)
        settings["data_dir"] = str(self.config.data_dir.resolve())
        return reopen, (type(self), settings, self._handle)
