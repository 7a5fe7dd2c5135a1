"""A fast, bounded walk over a pickle's opcodes, run before anything is unpickled.

CPython's unpickler trusts what a pickle claims in ways that cost memory or crash the
process: a `LONG_BINPUT` index sizes its memo array (16 bytes per claimed slot), and hashing
a tuple nested a million deep overflows the C stack. This walk simulates the unpickler's
stack just enough to refuse those shapes up front, finds where the pickle ends (legacy
files hold several pickles back to back), and lists the globals it names for the
`unsafe-pickle` report. It builds no object. Each opcode is one call of a small handler
that reads its own argument and returns the position of the next opcode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ckptfix.core.errors import Rejected

# Bounds a real checkpoint never reaches: a 1,000,000-tensor state dict pickles to about
# 116 MB in 30 million opcodes, of which about 4 million build containers. At these bounds
# the walk takes seconds and the unpickler's memory stays within about 1 GiB.
MAX_PICKLE_BYTES = 256 * 2**20
MAX_PICKLE_OPS = 48_000_000
MAX_CONTAINERS = 8_000_000
MAX_TUPLE_DEPTH = 100
MAX_LINE = 2**16
# A memo index may run ahead of the number of objects memoised so far by this much at most
# (picklers number them 0, 1, 2, ...; CPython sizes its memo array by the largest index).
MEMO_SLACK = 1024


class PickleRejected(Rejected):
    """The walk found a shape the unpickler must not see; `rule` names it."""


class PickleTruncated(PickleRejected):
    """The bytes ended before the pickle's STOP opcode."""

    def __init__(self, what: str = "pickle ends before its STOP opcode") -> None:
        super().__init__("bad-pickle", what)


@dataclass(frozen=True)
class ScanResult:
    end: int  # offset just after STOP
    globals: Counter[str]


Item = int | str  # on the simulated stack: a tuple-nesting depth, or a string's value


class _Walk:
    """The simulated stack and memo. `floor` is where the stack above the last MARK starts."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)
        self.stack: list[Item] = []
        self.marks: list[int] = []
        self.floor = 0
        self.memo: dict[int, Item] = {}
        self.found: Counter[str] = Counter()
        self.containers = 0
        self.end = -1

    def mark(self) -> None:
        self.marks.append(len(self.stack))
        self.floor = len(self.stack)

    def to_mark(self) -> list[Item]:
        if not self.marks:
            raise PickleRejected("bad-pickle", "pickle pops a MARK it never pushed")
        start = self.marks.pop()
        self.floor = self.marks[-1] if self.marks else 0
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def pop(self, count: int) -> list[Item]:
        if len(self.stack) - count < self.floor:
            raise PickleRejected("bad-pickle", "pickle pops past the top of its stack")
        items = self.stack[-count:]
        del self.stack[-count:]
        return items

    def push_container(self, depth: int) -> None:
        self.containers += 1
        if self.containers > MAX_CONTAINERS:
            raise PickleRejected(
                "pickle-too-large", f"pickle builds over {MAX_CONTAINERS} containers"
            )
        if depth > MAX_TUPLE_DEPTH:
            raise PickleRejected(
                "nesting-too-deep", f"pickle nests tuples more than {MAX_TUPLE_DEPTH} deep"
            )
        self.stack.append(depth)

    def push_tuple(self, items: list[Item]) -> None:
        depth = 0
        for item in items:
            if type(item) is int and item > depth:
                depth = item
        self.push_container(depth + 1)

    def memo_put(self, index: int) -> None:
        if len(self.stack) <= self.floor:
            raise PickleRejected("bad-pickle", "pickle memoises an empty stack")
        if index > len(self.memo) + MEMO_SLACK:
            raise PickleRejected(
                "memo-index",
                f"pickle memo index {index} runs far ahead of the {len(self.memo)} objects "
                "memoised so far",
            )
        self.memo[index] = self.stack[-1]

    def memo_get(self, index: int) -> None:
        try:
            self.stack.append(self.memo[index])
        except KeyError:
            raise PickleRejected(
                "bad-pickle", f"pickle reads memo slot {index}, never set"
            ) from None


# A handler takes the walk, the data and the position after its opcode byte, and returns
# the position of the next opcode.
Handler = Callable[[_Walk, bytes, int], int]


def _need(data: bytes, end: int) -> int:
    if end > len(data):
        raise PickleTruncated("pickle ends inside an opcode's argument")
    return end


def _line(data: bytes, pos: int) -> int:
    """The position after the newline that ends the line starting at `pos`."""
    end = data.find(b"\n", pos, pos + MAX_LINE)
    if end < 0:
        if len(data) < pos + MAX_LINE:
            raise PickleTruncated("pickle ends inside a line argument")
        raise PickleRejected("bad-pickle", f"pickle line argument is over {MAX_LINE} bytes")
    return end + 1


def _counted(data: bytes, pos: int, width: int) -> tuple[int, int]:
    """(start, end) of a length-prefixed argument."""
    start = _need(data, pos + width)
    return start, _need(data, start + int.from_bytes(data[pos:start], "little"))


def _not_unicode() -> PickleRejected:
    # CPython decodes pickled text with "surrogatepass": a lone surrogate would become a
    # name that no safetensors header, JSON document or terminal can hold.
    return PickleRejected(
        "bad-pickle", "pickle holds a string that is not valid Unicode (a lone surrogate)"
    )


def _decode(body: bytes) -> Item:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise _not_unicode() from None


def _decimal(text: bytes) -> int:
    text = text.strip()
    if not text.isdigit() or len(text) > 18:
        raise PickleRejected("bad-pickle", f"pickle memo index {text[:20]!r} is not a number")
    return int(text)


def _fixed(width: int) -> Handler:
    def push_scalar(walk: _Walk, data: bytes, pos: int) -> int:
        walk.stack.append(0)
        end = pos + width
        return _need(data, end) if end > walk.size else end

    return push_scalar


def _counted_scalar(width: int) -> Handler:
    def push_bytes(walk: _Walk, data: bytes, pos: int) -> int:
        walk.stack.append(0)
        return _counted(data, pos, width)[1]

    return push_bytes


def _line_scalar(walk: _Walk, data: bytes, pos: int) -> int:
    walk.stack.append(0)
    return _line(data, pos)


def _unicode(width: int) -> Handler:
    def push_string(walk: _Walk, data: bytes, pos: int) -> int:
        start, end = _counted(data, pos, width)
        walk.stack.append(_decode(data[start:end]))
        return end

    return push_string


def _line_string(walk: _Walk, data: bytes, pos: int) -> int:
    end = _line(data, pos)
    walk.stack.append(data[pos : end - 1].strip(b"'\"").decode("latin-1"))
    return end


def _line_unicode(walk: _Walk, data: bytes, pos: int) -> int:
    """UNICODE (protocol 0): raw-unicode-escape text, whose escapes can make surrogates."""
    end = _line(data, pos)
    try:
        text = data[pos : end - 1].decode("raw-unicode-escape")
        text.encode("utf-8")
    except UnicodeError:
        raise _not_unicode() from None
    walk.stack.append(text)
    return end


def _binput(width: int) -> Handler:
    """BINPUT, LONG_BINPUT: about a quarter of a torch pickle's opcodes, so inlined."""

    def put(walk: _Walk, data: bytes, pos: int) -> int:
        end = pos + width
        index = int.from_bytes(data[pos:end], "little")
        stack, memo = walk.stack, walk.memo
        if end > walk.size or index > len(memo) + MEMO_SLACK or len(stack) <= walk.floor:
            _need(data, end)
            walk.memo_put(index)  # raises with the reason
        memo[index] = stack[-1]
        return end

    return put


def _binget(width: int) -> Handler:
    def get(walk: _Walk, data: bytes, pos: int) -> int:
        end = pos + width
        try:
            walk.stack.append(walk.memo[int.from_bytes(data[pos:end], "little")])
        except KeyError:
            walk.memo_get(int.from_bytes(data[pos:end], "little"))
        return _need(data, end) if end > walk.size else end

    return get


def _put(walk: _Walk, data: bytes, pos: int) -> int:
    end = _line(data, pos)
    walk.memo_put(_decimal(data[pos:end]))
    return end


def _get(walk: _Walk, data: bytes, pos: int) -> int:
    end = _line(data, pos)
    walk.memo_get(_decimal(data[pos:end]))
    return end


def _memoize(walk: _Walk, data: bytes, pos: int) -> int:
    walk.memo_put(len(walk.memo))
    return pos


def _mark(walk: _Walk, data: bytes, pos: int) -> int:
    walk.mark()
    return pos


def _tuple_n(count: int) -> Handler:
    def build_tuple(walk: _Walk, data: bytes, pos: int) -> int:
        walk.push_tuple(walk.pop(count) if count else [])
        return pos

    return build_tuple


def _tuple1(walk: _Walk, data: bytes, pos: int) -> int:
    """TUPLE1, the commonest tuple (every tensor's stride or shape of one dimension)."""
    stack = walk.stack
    if len(stack) <= walk.floor:
        raise PickleRejected("bad-pickle", "pickle pops past the top of its stack")
    item = stack.pop()
    walk.push_container(item + 1 if type(item) is int else 1)
    return pos


def _tuple(walk: _Walk, data: bytes, pos: int) -> int:
    walk.push_tuple(walk.to_mark())
    return pos


def _empty_container(walk: _Walk, data: bytes, pos: int) -> int:
    walk.push_container(0)  # lists, dicts and sets are unhashable: no hash recursion
    return pos


def _container_from_mark(walk: _Walk, data: bytes, pos: int) -> int:
    walk.to_mark()
    walk.push_container(0)
    return pos


def _pop_to_mark(walk: _Walk, data: bytes, pos: int) -> int:
    walk.to_mark()
    return pos


def _pop_one(walk: _Walk, data: bytes, pos: int) -> int:
    walk.pop(1)
    return pos


def _pop_two(walk: _Walk, data: bytes, pos: int) -> int:
    walk.pop(2)
    return pos


def _pop(walk: _Walk, data: bytes, pos: int) -> int:
    if walk.marks and walk.marks[-1] == len(walk.stack):
        walk.to_mark()  # POP with nothing above a MARK pops the MARK
    else:
        walk.pop(1)
    return pos


def _dup(walk: _Walk, data: bytes, pos: int) -> int:
    walk.stack.append(walk.pop(1)[0])
    walk.stack.append(walk.stack[-1])
    return pos


def _persistent(walk: _Walk, data: bytes, pos: int) -> int:
    if len(walk.stack) <= walk.floor:
        raise PickleRejected("bad-pickle", "pickle pops past the top of its stack")
    walk.stack[-1] = 0
    return pos


def _call(count: int) -> Handler:
    """REDUCE, NEWOBJ, NEWOBJ_EX: the result is taken to be as deep as its arguments."""

    def call(walk: _Walk, data: bytes, pos: int) -> int:
        stack = walk.stack
        if len(stack) - count < walk.floor:
            raise PickleRejected("bad-pickle", "pickle pops past the top of its stack")
        arguments = stack[1 - count]
        del stack[1 - count :]
        stack[-1] = arguments
        return pos

    return call


def _global_name(raw: bytes) -> str:
    module, _, name = raw.decode("latin-1").rstrip("\n").partition("\n")
    return f"{module}.{name}"


def _global(walk: _Walk, data: bytes, pos: int) -> int:
    end = _line(data, _line(data, pos))
    walk.found[_global_name(data[pos:end])] += 1
    walk.stack.append(0)
    return end


def _inst(walk: _Walk, data: bytes, pos: int) -> int:
    end = _global(walk, data, pos)
    walk.stack.pop()
    walk.to_mark()
    walk.stack.append(0)
    return end


def _stack_global(walk: _Walk, data: bytes, pos: int) -> int:
    module, name = walk.pop(2)
    known = type(module) is str and type(name) is str
    walk.found[f"{module}.{name}" if known else "<computed name>"] += 1
    walk.stack.append(0)
    return pos


def _frame(walk: _Walk, data: bytes, pos: int) -> int:
    # The unpickler checks a frame against the bytes that follow; only absurd lengths
    # (which overflow its arithmetic) need refusing here.
    end = _need(data, pos + 8)
    if int.from_bytes(data[pos:end], "little") > len(data):
        raise PickleTruncated("pickle FRAME claims more bytes than the pickle has")
    return end


def _proto(walk: _Walk, data: bytes, pos: int) -> int:
    return _need(data, pos + 1)


def _stop(walk: _Walk, data: bytes, pos: int) -> int:
    walk.end = pos
    return len(data) + 1


def _forbidden(walk: _Walk, data: bytes, pos: int) -> int:
    raise PickleRejected("out-of-band-buffer", "pickle uses out-of-band buffers (protocol 5)")


def _unknown(walk: _Walk, data: bytes, pos: int) -> int:
    raise PickleRejected("bad-pickle", f"unknown pickle opcode 0x{data[pos - 1]:02x}")


def _table() -> list[Handler]:
    handlers: list[Handler] = [_unknown] * 256

    def on(codes: str, handler: Handler) -> None:
        for code in codes:
            handlers[ord(code)] = handler

    on("N\x88\x89", _fixed(0))
    on("K", _fixed(1))
    on("M\x82", _fixed(2))
    on("\x83", _fixed(2))
    on("J\x84", _fixed(4))
    on("G", _fixed(8))
    on("C\x8a", _counted_scalar(1))
    on("B\x8b", _counted_scalar(4))
    on("\x8e\x96", _counted_scalar(8))
    on("FILP", _line_scalar)
    on("}]\x8f", _empty_container)
    on("\x8cU", _unicode(1))
    on("XT", _unicode(4))
    on("\x8d", _unicode(8))
    on("S", _line_string)
    on("V", _line_unicode)
    on("q", _binput(1))
    on("r", _binput(4))
    on("h", _binget(1))
    on("j", _binget(4))
    on("p", _put)
    on("g", _get)
    on("\x94", _memoize)
    on("(", _mark)
    on(")", _tuple_n(0))
    on("\x85", _tuple1)
    on("\x86", _tuple_n(2))
    on("\x87", _tuple_n(3))
    on("t\x91", _tuple)
    on("dlo", _container_from_mark)
    on("e1u\x90", _pop_to_mark)
    on("ab", _pop_one)
    on("s", _pop_two)
    on("0", _pop)
    on("2", _dup)
    on("Q", _persistent)
    on("R\x81", _call(2))
    on("\x92", _call(3))
    on("c", _global)
    on("i", _inst)
    on("\x93", _stack_global)
    on("\x95", _frame)
    on("\x80", _proto)
    on(".", _stop)
    on("\x97\x98", _forbidden)
    return handlers


_HANDLERS = _table()


def scan(data: bytes, start: int = 0, limit: int = MAX_PICKLE_BYTES) -> ScanResult:
    """Walk one pickle from `start`; raise PickleRejected (PickleTruncated when the bytes
    end first), or return where it ends and the globals it names."""
    walk = _Walk(data)
    handlers = _HANDLERS
    size = min(len(data), start + limit)
    pos = start
    for _ in range(MAX_PICKLE_OPS):  # counts opcodes at no cost per opcode
        if pos >= size:
            break
        pos = handlers[data[pos]](walk, data, pos + 1)
    else:
        raise PickleRejected("pickle-too-large", f"pickle has over {MAX_PICKLE_OPS} opcodes")
    if walk.end >= 0:
        return ScanResult(walk.end, walk.found)
    if size < len(data):
        raise PickleRejected("pickle-too-large", f"pickle is over {limit} bytes")
    raise PickleTruncated()
