"""The solution's side of grading: a process that loads the solution and calls its functions.

It holds no test and no expected value. The host (grader.py) sends one JSON request per line
on stdin and reads one JSON answer per line on stdout:

    {"main": "solution.py"}                    -> {"loaded": true} | {"load_error": "..."}
    {"call": NAME, "args": W, "kwargs": W}     -> {"value": W, "args": W}          (args: after the call)
                                                | {"raised": "ValueError", "message": "..."}

where W is a value in the wire format below. Everything it answers is a claim by code the
agent wrote (it can print anything, exit, or hang): the judge on the host only decodes it
into plain values and runs the hidden tests against them, so the worst a forged answer can
do is claim the values the correct solution returns -- which is solving the task.

Wire format (JSON): None, bools, str and lists are themselves; every other value is a
one-key object: {"i": hex int}, {"f": float.hex}, {"c": [re, im] float.hex}, {"b": base64
bytes}, {"t": [..]} tuple, {"s": [..]} set, {"fs": [..]} frozenset, {"d": [[k, v], ..]} dict,
{"q": [num, den]} Fraction, {"m": str} Decimal, {"x": type name} a value that has no plain
form (it equals nothing). Standard library only: this file's source runs in the sandbox.
"""

import base64
import json
import os
import sys
from decimal import Decimal
from fractions import Fraction

MAX_DEPTH = 100
MAX_INT_HEX = 1 << 20       # hex digits of one int (4 Mbit: decoding is linear)
MAX_FRACTION_HEX = 1 << 14  # of a Fraction's numerator and denominator (normalizing them is quadratic)
MAX_HASH_REPEATS = 32       # items of one set or dict sharing a hash (more: a forged hash flood)


class Opaque:
    """A value the solution returned that has no plain form: it equals nothing but itself."""

    __slots__ = ("type_name",)

    def __init__(self, type_name):
        self.type_name = str(type_name)[:100]

    def __repr__(self):
        return "<unrepresentable %s>" % self.type_name


def encode(x, strict=True, depth=0):
    """A value -> the wire format. strict: refuse what has no plain form (TypeError), else
    send it as {"x": type name}; subclasses of the plain types travel as their base type."""
    if depth > MAX_DEPTH:
        raise ValueError("nested deeper than %d" % MAX_DEPTH)
    d = depth + 1
    if x is None or x is True or x is False:
        return x
    if strict and type(x) not in _PLAIN:
        raise TypeError("the grader cannot pass a %s to the solution" % type(x).__name__)
    if type(x).__module__ == "numpy" and getattr(x, "shape", None) == ():
        x = x.item()  # numpy scalars travel as the Python number they hold
    if isinstance(x, bool):
        return bool(x)
    if isinstance(x, int):
        return {"i": format(int(x), "x")}
    if isinstance(x, float):
        return {"f": float(x).hex()}
    if isinstance(x, complex):
        return {"c": [x.real.hex(), x.imag.hex()]}
    if isinstance(x, str):
        return str(x)
    if isinstance(x, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, list):
        return [encode(v, strict, d) for v in x]
    if isinstance(x, tuple):
        return {"t": [encode(v, strict, d) for v in x]}
    if isinstance(x, frozenset):
        return {"fs": [encode(v, strict, d) for v in x]}
    if isinstance(x, set):
        return {"s": [encode(v, strict, d) for v in x]}
    if isinstance(x, dict):
        return {"d": [[encode(k, strict, d), encode(v, strict, d)] for k, v in x.items()]}
    if isinstance(x, Fraction):
        return {"q": [format(x.numerator, "x"), format(x.denominator, "x")]}
    if isinstance(x, Decimal):
        return {"m": str(x)}
    return {"x": type(x).__name__}


_PLAIN = {type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict,
          Fraction, Decimal}


def _int(s, max_hex=MAX_INT_HEX):
    if not isinstance(s, str) or len(s) > max_hex:
        raise ValueError("bad int")
    return int(s, 16)


def _hashable(items):
    """items, unless too many of them share a hash: ints that differ by multiples of 2**61 - 1 all
    hash alike, and a set of thousands of them takes seconds to build (an answer must not stall
    the judge). A set or dict the solution really returned has distinct members, rarely colliding."""
    if len(items) > MAX_HASH_REPEATS:
        counts = {}
        for item in items:
            h = hash(item)
            counts[h] = counts.get(h, 0) + 1
            if counts[h] > MAX_HASH_REPEATS:
                raise ValueError("more than %d members share a hash" % MAX_HASH_REPEATS)
    return items


def decode(w, depth=0):
    """The wire format -> plain values (only the types above, or Opaque); ValueError when malformed."""
    if depth > MAX_DEPTH:
        raise ValueError("nested deeper than %d" % MAX_DEPTH)
    d = depth + 1
    if w is None or w is True or w is False or isinstance(w, str):
        return w
    if isinstance(w, list):
        return [decode(v, d) for v in w]
    if not isinstance(w, dict) or len(w) != 1:
        raise ValueError("not a wire value: %s" % type(w).__name__)
    (tag, v), = w.items()
    try:
        if tag == "i":
            return _int(v)
        if tag == "f":
            return float.fromhex(v)
        if tag == "c":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if tag == "b":
            return base64.b64decode(v, validate=True)
        if tag in ("t", "s", "fs"):
            if not isinstance(v, list):
                raise ValueError("not a list")
            items = [decode(x, d) for x in v]
            if tag == "t":
                return tuple(items)
            return (set if tag == "s" else frozenset)(_hashable(items))
        if tag == "d":
            if not isinstance(v, list):
                raise ValueError("not a list")
            pairs = [(decode(k, d), decode(x, d)) for k, x in v]
            _hashable([k for k, _ in pairs])
            return dict(pairs)
        if tag == "q":
            return Fraction(_int(v[0], MAX_FRACTION_HEX), _int(v[1], MAX_FRACTION_HEX))
        if tag == "m":
            return Decimal(str(v))
        if tag == "x":
            return Opaque(v)
    except (TypeError, ValueError, IndexError, ArithmeticError) as e:  # unhashable key, bad number, ...
        raise ValueError("bad %r value: %s" % (tag, e)) from None
    raise ValueError("unknown wire tag %r" % tag)


def _error_text(exc):
    try:
        msg = str(exc)
    except BaseException:
        msg = ""
    try:
        name = type(exc).__name__
    except BaseException:
        name = "BaseException"
    return str(name)[:100], msg[:300]


def main():
    # the protocol keeps private copies of stdin/stdout; the solution's print()/input() see /dev/null
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    sys.stdin = open(os.devnull)
    sys.stdout = open(os.devnull, "w")

    def answer(obj):
        answers.write(json.dumps(obj).encode() + b"\n")
        answers.flush()

    first = json.loads(requests.readline())
    try:  # a hard CPU limit: a busy loop left behind dies even where the host cannot reach it
        import resource
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        cpu_s = int(first["cpu_s"]) if hard == resource.RLIM_INFINITY else min(int(first["cpu_s"]), hard)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    except (ImportError, KeyError, ValueError, OSError):
        pass
    import runpy
    sys.path.insert(0, os.getcwd())
    try:
        namespace = runpy.run_path(first["main"], run_name="solution")
    except BaseException as exc:
        answer({"load_error": "%s: %s" % _error_text(exc)})
        return
    answer({"loaded": True})
    for line in requests:
        req = json.loads(line)
        args, kwargs = decode(req["args"]), decode(req["kwargs"])
        fn = namespace.get(req["call"])
        if not callable(fn):
            answer({"raised": "NameError", "message": "the solution defines no function %r" % req["call"]})
            continue
        try:
            value = fn(*args, **kwargs)
            out = {"value": encode(value, strict=False), "args": encode(args, strict=False)}
        except BaseException as exc:
            name, msg = _error_text(exc)
            out = {"raised": name, "message": msg}
        answer(out)


if __name__ == "__main__":
    main()
