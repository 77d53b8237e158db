"""Where the code a call ships to the ranks was written, kept whatever the serializer does with it.

A function defined in a notebook cell reaches the ranks by value, and the serializer decides what its code
objects' filenames are on arrival: cloudpickle 3.1.3 writes `<dynamic-code>` for every one of them, so a
traceback, a hang stack or a faulthandler dump would lose the cell. The kernel therefore records, for each
code object a call ships, the filename it was compiled under (`origins`), and the rank gives each code object
it received its filename back before it runs the call (`restore`). Both sides walk the same objects: the
function (a bound method's function, a partial's), the functions and classes it reaches through its globals
and closure, the methods of those classes, and the same for functions, classes and instances passed as
arguments, stopping at anything that is not shipped by value (imported code keeps its own files).
"""

from __future__ import annotations

import functools
import hashlib
import types

_MAX_ITEMS = 64

def _by_value(obj) -> bool:
    """True for code the serializer ships by value: defined in the notebook (or registered to go by value)."""
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        return True
    try:
        import cloudpickle
        return module in cloudpickle.list_registry_pickle_by_value()   # module names
    except (ImportError, AttributeError):
        return False


def _key(code: types.CodeType) -> tuple:
    """What identifies a code object on both sides, whatever its filename became."""
    return (getattr(code, "co_qualname", code.co_name), code.co_firstlineno,
            hashlib.blake2b(code.co_code, digest_size=8).hexdigest())


def _nested(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _functions(roots) -> list:
    """Every function reachable from `roots` that is shipped by value, each once."""
    seen, found, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (types.MethodType, staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, property):
            todo += [f for f in (obj.fget, obj.fset, obj.fdel) if f is not None]
        elif isinstance(obj, (list, tuple, set, frozenset, dict)):
            if len(obj) <= _MAX_ITEMS:  # a few functions in a list; not a data set
                todo += list(obj.values() if isinstance(obj, dict) else obj)
        elif isinstance(obj, types.FunctionType):
            if not _by_value(obj):
                continue
            found.append(obj)
            names = {n for code in _nested(obj.__code__) for n in code.co_names}
            todo += [obj.__globals__[n] for n in names if n in obj.__globals__]
            todo += [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
        elif isinstance(obj, type):
            if _by_value(obj):
                todo += list(vars(obj).values()) + list(obj.__bases__)
        elif _by_value(type(obj)):  # an instance of a notebook class: its class's methods
            todo.append(type(obj))
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def origins(*roots) -> dict:
    """Kernel side: key -> filename for every code object shipped by value with `roots`."""
    return {_key(code): code.co_filename for fn in _functions(roots) for code in _nested(fn.__code__)}


def _renamed(code: types.CodeType, table: dict) -> types.CodeType:
    consts = tuple(_renamed(c, table) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    filename = table.get(_key(code), code.co_filename)
    # (`is`, not ==: code objects compare equal whatever their filenames)
    if filename == code.co_filename and all(a is b for a, b in zip(consts, code.co_consts)):
        return code
    return code.replace(co_filename=filename, co_consts=consts)


def restore(table: dict, *roots) -> None:
    """Rank side: give every received code object reachable from `roots` the filename the kernel recorded."""
    if not table:
        return
    for fn in _functions(roots):
        code = _renamed(fn.__code__, table)
        if code is not fn.__code__:
            fn.__code__ = code


def classes_by_cloudpickle() -> None:
    """Send classes with cloudpickle, as functions already go (`DirectView.use_cloudpickle` leaves classes to
    ipyparallel's canning). ipyparallel rebuilds a class it sends with `type(name, bases, dict)`, but its methods
    still refer to the original class in their `__class__` cell, so `super()` without arguments fails on the rank
    ("obj must be an instance or subtype of type"), and the rank's `isinstance` sees two classes. Run it on both
    sides: the kernel and every rank."""
    from ipyparallel.serialize import canning

    canning.can_map.pop(type, None)
