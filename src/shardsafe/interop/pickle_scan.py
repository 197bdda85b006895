"""Is this pickle stream within what the restricted loader accepts? Checked before and after unpickling.

:func:`scan_pickle` walks the opcodes (``pickletools.genops``) of a ``torch.save`` pickle without
running any of them, keeping a symbolic stack: which opcodes occur (an exact allow-list: protocol 2,
the opcodes ``torch.save`` emits for dicts, lists, tuples, strings, numbers, globals and persistent
storage ids), which globals are named (an exact list, each either a value, a callable that REDUCE may
call, or a class that NEWOBJ may instantiate and BUILD may fill), what REDUCE calls, what NEWOBJ builds
and what BUILD fills, memo indices (dense: a ``LONG_BINPUT 0xffffffff`` would make the C unpickler
allocate a 32 GiB memo), integer sizes (at most 64 bits), strings (valid UTF-8) and the counts
(bytes, opcodes, nesting). So no ``bytearray``/``eval``/``os.system`` call, no INST/OBJ/EXT code
path, no out-of-band buffer reaches the unpickler, and the objects it builds are bounded by the
pickle's bytes.

:func:`check_value_graph` walks what was unpickled (iteratively) and refuses cycles, nesting deeper
than :data:`MAX_NESTING` and sharing that would expand into more than :data:`MAX_EXPANDED` values when
walked as a tree (``x = [y, y]; y = [z, z]; ...`` is small in the file, exponential to its readers).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardsafe.errors import FormatError

__all__ = ["GlobalRules", "MAX_DIMS", "MAX_PICKLE_BYTES", "check_value_graph", "scan_pickle", "RestrictedUnpickler"]

MAX_PICKLE_BYTES = 64 << 20  # DeepSpeed's pickles hold names, shapes and hyper-parameters: kilobytes to a few MiB
MAX_OPCODES = 4_000_000  # about 30 per tensor: 100,000+ tensors in one file
MAX_NESTING = 64  # DeepSpeed nests 8 deep; the ds_config a few more
MAX_EXPANDED = 8_000_000  # values seen when the object graph is walked as a tree (shared values counted per use)
MAX_DIMS = 64  # dimensions of a shape

# The opcodes the protocol-2 pickler emits for the values torch.save writes; nothing else is unpickled.
ALLOWED_OPCODES = frozenset(
    {
        "PROTO", "STOP", "MARK", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
        "BINUNICODE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND",
        "APPENDS", "SETITEM", "SETITEMS", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "GLOBAL", "REDUCE",
        "NEWOBJ", "BUILD", "BINPERSID",
    }
)  # fmt: skip
# What protocol 4 adds (``pickle.dump`` of DCP's ``.metadata``): frames, short strings, memoize, STACK_GLOBAL.
PROTOCOL4_OPCODES = frozenset({"FRAME", "SHORT_BINUNICODE", "MEMOIZE", "STACK_GLOBAL"})


@dataclass(frozen=True)
class GlobalRules:
    """The globals a pickle may name (``"module.name"``), by what the pickle may do with them."""

    values: frozenset[str]  # used as plain values only (dtypes, storage types, the tensor type)
    callables: frozenset[str]  # what REDUCE may call (each a checking wrapper, see the unpickler)
    classes: frozenset[str]  # what NEWOBJ may instantiate and BUILD may then fill with a dict
    protocols: frozenset[int] = frozenset({2})  # torch.save writes 2; DCP's .metadata is a protocol-4 pickle.dump
    tuple_state: frozenset[str] = frozenset()  # classes BUILD may fill with a tuple (a __getstate__ returning one)
    persistent_ids: bool = True  # whether BINPERSID (torch storages) may occur

    def __contains__(self, name: str) -> bool:
        return name in self.values or name in self.callables or name in self.classes


@dataclass  # mutable: a container's depth grows as the scan nests items into it
class _Sym:
    """What the scan knows about one stack value: its kind, the global it came from, its length, its nesting."""

    kind: str  # "mark", "global", "dict", "list", "tuple", "call", "new", "pid", "leaf"
    name: str = ""
    length: int = 0
    depth: int = 1


_MARK = _Sym("mark")
_LEAF = _Sym("leaf")


@dataclass  # mutable: counts opcodes, persistent ids and globals while scanning
class ScanReport:
    """What :func:`scan_pickle` counted in an accepted stream."""

    opcodes: int = 0
    persistent_ids: int = 0
    globals: set[str] = field(default_factory=set)


def scan_pickle(data: bytes, where: str, rules: GlobalRules) -> ScanReport:
    """Refuse (:class:`FormatError` naming ``where``) a pickle that steps outside the allow-lists; nothing is
    unpickled."""
    if len(data) > MAX_PICKLE_BYTES:
        raise FormatError(f"{where}: a pickle of {len(data)} bytes is more than the {MAX_PICKLE_BYTES} allowed")
    report = ScanReport()
    try:
        _Scan(where, rules, report).run(pickletools.genops(io.BytesIO(data)), len(data))
    except FormatError:
        raise
    except Exception as exc:  # genops on a malformed stream: ValueError, UnicodeDecodeError, struct.error, ...
        raise FormatError(f"{where}: not a readable pickle stream ({type(exc).__name__})") from None
    return report


class _Scan:
    def __init__(self, where: str, rules: GlobalRules, report: ScanReport) -> None:
        self.where, self.rules, self.report = where, rules, report
        self.stack: list[_Sym] = []
        self.marks = 0
        self.memo: dict[int, _Sym] = {}

    def refuse(self, pos: int, what: str) -> FormatError:
        return FormatError(f"{self.where}: refused pickle: {what} (at byte {pos})")

    def pop(self, pos: int, op: str) -> _Sym:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.refuse(pos, f"{op} on an empty stack")
        return self.stack.pop()

    def pop_to_mark(self, pos: int, op: str) -> list[_Sym]:
        if not self.marks:
            raise self.refuse(pos, f"{op} without a MARK")
        items: list[_Sym] = []
        while (item := self.stack.pop()) is not _MARK:
            items.append(item)
        self.marks -= 1
        items.reverse()
        return items

    def top(self, pos: int, op: str, kinds: tuple[str, ...]) -> _Sym:
        if not self.stack or self.stack[-1].kind not in kinds:
            found = self.stack[-1].kind if self.stack else "nothing"
            raise self.refuse(pos, f"{op} on a {found}, not a {' or '.join(kinds)}")
        return self.stack[-1]

    def nest(self, container: _Sym, items: Iterable[_Sym], pos: int) -> None:
        for item in items:
            if item is container:
                raise self.refuse(pos, "a container holding itself")
            container.depth = max(container.depth, item.depth + 1)
        if container.depth > MAX_NESTING:
            raise self.refuse(pos, f"values nested more than {MAX_NESTING} deep")

    def container(self, kind: str, items: list[_Sym], pos: int, name: str = "") -> _Sym:
        made = _Sym(kind, name, len(items))
        self.nest(made, items, pos)
        return made

    def named_global(self, qualified: str, pos: int) -> None:
        if qualified not in self.rules:
            raise self.refuse(pos, f"global {qualified[:120]!r} is not allowed")
        self.report.globals.add(qualified)
        self.stack.append(_Sym("global", qualified))

    def run(self, ops: Iterable[tuple[Any, Any, int | None]], size: int) -> None:
        stopped = False
        pos = 0
        for count, (opcode, arg, at) in enumerate(ops):
            pos = at or 0
            if count >= MAX_OPCODES:
                raise self.refuse(pos, f"more than {MAX_OPCODES} opcodes")
            name = opcode.name
            if name not in ALLOWED_OPCODES and not (4 in self.rules.protocols and name in PROTOCOL4_OPCODES):
                raise self.refuse(pos, f"opcode {name} is not allowed")
            if (count == 0) != (name == "PROTO"):
                raise self.refuse(pos, "PROTO must come first, once")
            if name == "PROTO" and arg not in self.rules.protocols:
                raise self.refuse(
                    pos, f"pickle protocol {arg}; expected {' or '.join(map(str, sorted(self.rules.protocols)))}"
                )
            stopped = self.step(name, arg, pos)
            self.report.opcodes = count + 1
        if not stopped:
            raise FormatError(f"{self.where}: refused pickle: no STOP within its {size} bytes")
        if pos + 1 != size:  # genops and the unpickler stop at STOP; torch.save writes nothing after it
            raise self.refuse(pos, f"{size - pos - 1} bytes after STOP")
        if len(self.stack) != 1 or self.marks:
            raise FormatError(f"{self.where}: refused pickle: {len(self.stack)} values left at STOP")

    def step(self, name: str, arg: Any, pos: int) -> bool:
        """Apply one opcode to the symbolic stack (one handler per opcode, see :data:`_HANDLERS`); True at STOP."""
        handler = _HANDLERS.get(name)
        if handler is None:  # pragma: no cover - ALLOWED_OPCODES and _HANDLERS list the same opcodes
            raise self.refuse(pos, f"opcode {name} is not handled")
        handler(self, name, arg, pos)
        return name == "STOP"

    def on_nothing(self, name: str, arg: Any, pos: int) -> None:
        """PROTO (checked by :meth:`run`), STOP, FRAME (a length hint; the opcodes inside are scanned like any
        others)."""

    def on_mark(self, name: str, arg: Any, pos: int) -> None:
        if self.marks >= MAX_NESTING:
            raise self.refuse(pos, f"MARKs nested more than {MAX_NESTING} deep")
        self.marks += 1
        self.stack.append(_MARK)

    def on_leaf(self, name: str, arg: Any, pos: int) -> None:
        self.stack.append(_LEAF)

    def on_long1(self, name: str, arg: Any, pos: int) -> None:
        if not -(1 << 63) <= arg < (1 << 64):
            raise self.refuse(pos, "an integer wider than 64 bits")
        self.stack.append(_LEAF)

    def on_unicode(self, name: str, arg: Any, pos: int) -> None:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise self.refuse(pos, "a string that is not valid UTF-8") from None
        self.stack.append(_Sym("str", arg[:200]))  # kept (short) for STACK_GLOBAL

    def on_memoize(self, name: str, arg: Any, pos: int) -> None:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.refuse(pos, f"{name} on an empty stack")
        self.memo[len(self.memo)] = self.stack[-1]

    def on_stack_global(self, name: str, arg: Any, pos: int) -> None:
        member, module = self.pop(pos, name), self.pop(pos, name)
        if member.kind != "str" or module.kind != "str":
            raise self.refuse(pos, "STACK_GLOBAL of values that are not strings")
        self.named_global(f"{module.name}.{member.name}", pos)

    def on_empty(self, name: str, arg: Any, pos: int) -> None:
        """EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE."""
        self.stack.append(_Sym(_EMPTY_KINDS[name]))

    def on_tuple(self, name: str, arg: Any, pos: int) -> None:
        self.stack.append(self.container("tuple", self.pop_to_mark(pos, name), pos))

    def on_tuple_n(self, name: str, arg: Any, pos: int) -> None:
        """TUPLE1, TUPLE2, TUPLE3: the count is the name's last digit."""
        items = [self.pop(pos, name) for _ in range(int(name[-1]))][::-1]
        self.stack.append(self.container("tuple", items, pos))

    def on_append(self, name: str, arg: Any, pos: int) -> None:
        item = self.pop(pos, name)
        self.nest(self.top(pos, name, ("list",)), [item], pos)

    def on_appends(self, name: str, arg: Any, pos: int) -> None:
        items = self.pop_to_mark(pos, name)
        self.nest(self.top(pos, name, ("list",)), items, pos)

    def on_setitems(self, name: str, arg: Any, pos: int) -> None:
        """SETITEM, SETITEMS: into a dict, or an OrderedDict (a state dict) and nothing else REDUCE made."""
        items = [self.pop(pos, name), self.pop(pos, name)][::-1] if name == "SETITEM" else self.pop_to_mark(pos, name)
        if len(items) % 2:
            raise self.refuse(pos, "SETITEMS with a key and no value")
        target = self.top(pos, name, ("dict", "call"))
        if target.kind == "call" and target.name != "collections.OrderedDict":
            raise self.refuse(pos, f"{name} on the result of {target.name}")
        self.nest(target, items, pos)

    def on_put(self, name: str, arg: Any, pos: int) -> None:
        """BINPUT, LONG_BINPUT: dense indices only (a huge one would make the C unpickler allocate its memo)."""
        if not self.stack or self.stack[-1] is _MARK:
            raise self.refuse(pos, f"{name} on an empty stack")
        if not 0 <= arg <= len(self.memo):
            raise self.refuse(pos, f"memo index {arg} out of sequence ({len(self.memo)} entries)")
        self.memo[arg] = self.stack[-1]

    def on_get(self, name: str, arg: Any, pos: int) -> None:
        if arg not in self.memo:
            raise self.refuse(pos, f"memo index {arg} was never stored")
        self.stack.append(self.memo[arg])

    def on_global(self, name: str, arg: Any, pos: int) -> None:
        self.named_global(".".join(str(arg).split(" ", 1)), pos)

    def on_reduce(self, name: str, arg: Any, pos: int) -> None:
        args, func = self.pop(pos, name), self.pop(pos, name)
        if func.kind != "global" or func.name not in self.rules.callables:
            raise self.refuse(pos, f"REDUCE calls {func.name or 'a ' + func.kind}, which is not an allowed callable")
        if args.kind != "tuple":
            raise self.refuse(pos, f"REDUCE arguments are a {args.kind}, not a tuple")
        self.stack.append(self.container("call", [args], pos, func.name))

    def on_newobj(self, name: str, arg: Any, pos: int) -> None:
        args, cls = self.pop(pos, name), self.pop(pos, name)
        if cls.kind != "global" or cls.name not in self.rules.classes:
            raise self.refuse(pos, f"NEWOBJ of {cls.name or 'a ' + cls.kind}, which is not an allowed class")
        if args.kind != "tuple" or args.length:
            raise self.refuse(pos, f"NEWOBJ of {cls.name} with arguments")
        self.stack.append(_Sym("new", cls.name))

    def on_build(self, name: str, arg: Any, pos: int) -> None:
        state = self.pop(pos, name)
        target = self.top(pos, name, ("new", "call"))
        if target.kind == "call" and target.name != "collections.OrderedDict":  # a state dict's `_metadata`
            raise self.refuse(pos, f"BUILD of the result of {target.name}")
        if state.kind != "dict" and not (state.kind == "tuple" and target.name in self.rules.tuple_state):
            raise self.refuse(pos, f"BUILD of {target.name} with a {state.kind} state, not a dict")
        self.nest(target, [state], pos)

    def on_binpersid(self, name: str, arg: Any, pos: int) -> None:
        if not self.rules.persistent_ids:
            raise self.refuse(pos, "a persistent id (a storage reference) where none may occur")
        pid = self.pop(pos, name)
        if pid.kind != "tuple" or pid.length not in (5,):
            raise self.refuse(pos, "a persistent id that is not a 5-tuple")
        self.report.persistent_ids += 1
        self.stack.append(_Sym("pid"))


_EMPTY_KINDS = {"EMPTY_DICT": "dict", "EMPTY_LIST": "list", "EMPTY_TUPLE": "tuple"}
# Each allowed opcode's handler (ALLOWED_OPCODES | PROTOCOL4_OPCODES, exactly).
_HANDLERS: dict[str, Callable[[_Scan, str, Any, int], None]] = {
    "PROTO": _Scan.on_nothing,
    "STOP": _Scan.on_nothing,
    "FRAME": _Scan.on_nothing,
    "MARK": _Scan.on_mark,
    **dict.fromkeys(("NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT"), _Scan.on_leaf),
    "LONG1": _Scan.on_long1,
    "BINUNICODE": _Scan.on_unicode,
    "SHORT_BINUNICODE": _Scan.on_unicode,
    "MEMOIZE": _Scan.on_memoize,
    "STACK_GLOBAL": _Scan.on_stack_global,
    **dict.fromkeys(_EMPTY_KINDS, _Scan.on_empty),
    "TUPLE": _Scan.on_tuple,
    **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), _Scan.on_tuple_n),
    "APPEND": _Scan.on_append,
    "APPENDS": _Scan.on_appends,
    "SETITEM": _Scan.on_setitems,
    "SETITEMS": _Scan.on_setitems,
    "BINPUT": _Scan.on_put,
    "LONG_BINPUT": _Scan.on_put,
    "BINGET": _Scan.on_get,
    "LONG_BINGET": _Scan.on_get,
    "GLOBAL": _Scan.on_global,
    "REDUCE": _Scan.on_reduce,
    "NEWOBJ": _Scan.on_newobj,
    "BUILD": _Scan.on_build,
    "BINPERSID": _Scan.on_binpersid,
}


def check_value_graph(root: Any, where: str, containers: tuple[type, ...]) -> None:
    """Refuse an unpickled value graph with a cycle, nesting beyond :data:`MAX_NESTING` or a tree walk beyond
    :data:`MAX_EXPANDED`.

    ``containers`` are the stand-in classes whose instances hold values (in their ``__dict__``);
    dicts, lists and tuples are walked too, anything else is a leaf. Iterative, so no recursion limit.
    """
    sizes: dict[int, tuple[int, int]] = {}  # id -> (depth, expanded size) of a finished value
    active: set[int] = set()
    stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
    keep: list[Any] = []  # holds every visited value, so no id is reused during the walk
    while stack:
        value, children = stack[-1]
        if children is None:
            kids = _children(value, containers)
            if kids is None or id(value) in sizes:
                stack.pop()
                continue
            if id(value) in active:
                raise FormatError(f"{where}: refused pickle: a value that contains itself")
            active.add(id(value))
            keep.append(value)
            stack[-1] = (value, kids)
            for kid in kids:
                if _children(kid, containers) is not None and id(kid) not in sizes:
                    if id(kid) in active:
                        raise FormatError(f"{where}: refused pickle: a value that contains itself")
                    stack.append((kid, None))
            continue
        stack.pop()
        active.discard(id(value))
        depth, size = 1, 1
        for kid in children:
            kid_depth, kid_size = sizes.get(id(kid), (0, 1))
            depth, size = max(depth, kid_depth + 1), size + kid_size
        if depth > MAX_NESTING:
            raise FormatError(f"{where}: refused pickle: values nested more than {MAX_NESTING} deep")
        if size > MAX_EXPANDED:
            raise FormatError(f"{where}: refused pickle: shared values expand to more than {MAX_EXPANDED} when walked")
        sizes[id(value)] = (depth, size)


def _children(value: Any, containers: tuple[type, ...]) -> list[Any] | None:
    """The values ``value`` holds, or None for a leaf."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, containers):
        return list(vars(value).values())
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """The one unpickler of the interop readers: globals only from ``allowed`` (the second lock, after
    :func:`scan_pickle` refused every other one), persistent ids only through ``persistent`` (a
    ``torch.save`` archive's storages, see interop/unpickler.py) or refused (DCP's ``.metadata``)."""

    def __init__(
        self,
        data: bytes,
        allowed: Mapping[str, Any],
        persistent: Callable[[Any], Any] | None = None,
        what: str = "pickle",
    ) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._allowed, self._persistent, self._what = allowed, persistent, what

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in self._allowed:
            raise FormatError(f"refused pickle: global {qualified[:120]!r} is not allowed")
        return self._allowed[qualified]

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"refused pickle: a persistent id in {self._what}")
        return self._persistent(pid)
