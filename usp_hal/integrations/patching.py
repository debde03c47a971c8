"""Changes to another library's functions and registries, made only on request and undone on
request.  An integration that must replace a function of transformers (or register a name in
one of its interfaces) does it here, so that every such change is listed in one place, under
the "module.qualname" of what was changed, and can be put back.  Nothing here runs at import.

:func:`patch` replaces an attribute of a class or a module (once: a second call with the same
target changes nothing), :func:`register` adds a name to a transformers ``GeneralInterface``
(``AttentionInterface``, ``AttentionMaskInterface``), :func:`hook` installs a process-wide
hook of another library (torch's optimizer-step pre-hook) and keeps its handle, :func:`applied`
lists what is in place, :func:`restore_all` puts every original back (and removes the hooks).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

_MISSING = object()     # the target had no value of its own (an inherited attribute, a new name)


@dataclass
class _Change:
    owner: Any          # the class or module patched, or the mapping registered in
    name: str
    before: Any         # the owner's own value before the first change, or _MISSING
    after: Any
    undo: Optional[Callable[[], Any]] = None     # a hook's removal (its handle's remove())


_CHANGES: Dict[str, _Change] = {}        # label -> change, in the order made


def label(owner, name: str) -> str:
    """``"module.qualname"`` of ``owner.name`` (a module's function or a class's attribute)."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def patch(owner, name: str, make: Callable[[Any], Any]) -> str:
    """Replace ``owner.name`` by ``make(original)`` unless this already did; return its label."""
    key = label(owner, name)
    if key not in _CHANGES:
        before = vars(owner).get(name, _MISSING)
        after = make(getattr(owner, name))
        setattr(owner, name, after)
        _CHANGES[key] = _Change(owner, name, before, after)
    return key


def register(interface, name: str, value) -> str:
    """``interface.register(name, value)`` for a transformers ``GeneralInterface`` (its
    class-wide mapping, which every model reads), remembering what the name held before."""
    mapping = interface._global_mapping
    key = f"{interface.__module__}.{interface.__qualname__}[{name!r}]"
    if key not in _CHANGES:
        _CHANGES[key] = _Change(mapping, name, mapping.get(name, _MISSING), value)
    _CHANGES[key].after = value
    interface.register(name, value)
    return key


def hook(key: str, install: Callable[[], Any]) -> str:
    """Install a process-wide hook under the label ``key`` unless it is in place: ``install()``
    registers it and returns its handle (``handle.remove()`` undoes it, in :func:`restore_all`)."""
    if key not in _CHANGES:
        handle = install()
        _CHANGES[key] = _Change(handle, "remove", _MISSING, handle, undo=handle.remove)
    return key


def is_applied(key: str) -> bool:
    """Whether the change labelled ``key`` is in place (a dictionary lookup)."""
    return key in _CHANGES


def applied() -> List[str]:
    """The labels of the changes in place, in the order made."""
    return list(_CHANGES)


def restore_all() -> List[str]:
    """Put back every original (the last change first); return the labels undone."""
    done = []
    for key, change in reversed(list(_CHANGES.items())):
        owner, name, before = change.owner, change.name, change.before
        if change.undo is not None:
            change.undo()
        elif isinstance(owner, dict):
            if before is _MISSING:
                owner.pop(name, None)
            else:
                owner[name] = before
        elif before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
        done.append(key)
        del _CHANGES[key]
    return done[::-1]
