"""A seeded generator of small programming tasks for the code env, with train and test splits.

Each family is a kind of problem (string, list, dict, arithmetic, parsing, simple algorithms)
whose parameters vary (the letter to count, the divisor, the separator, the variant), so a
model that learned one instance has to read the next one's statement. An instance is

    Task(family, task_id, entry_point, text, solution, wrong, tests)

with ``tests`` MBPP-style asserts (``assert f(args) == expected``; expected values computed by
running the reference ``solution`` here, on inputs drawn from a generator seeded by the
statement) and ``wrong``: the family's typical mistake, which the tests are built to catch
(inputs are added until it fails one). The statement fixes the instance (the same statement
always gets the same tests), and its hash fixes the split: about one statement in five is
"test", the rest "train", so the two splits share no instance by construction.

    generate(seed=0, split="train")           # an endless stream of train tasks (env rows)
    generate(seed=1, split="test", n=200)     # 200 distinct held-out tasks
    task_from_id("gen/rotate/123")            # the instance behind a row's task_id (the expert's reference)

A family is one function, decorated with ``@family(category)``: it draws its parameters from
the RNG it is given and returns ``_fn(name, args, statement, solution, wrong, edge inputs,
drawer, **placeholders)`` (``_count_char`` is the simplest). Its draws fix its instances: changing
what an existing family draws, or in which order, changes the tasks of every seed (the digests
pinned in tests/envs/test_code_tasks.py say so); a new family changes the streams too.

Reference solutions run in this process: they are this file's own code, never a model's.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import random
import string
from dataclasses import dataclass
from string import Template
from typing import Any, Callable, Iterator

SPLITS = ("train", "test")
TEST_SHARE = 5  # one statement in TEST_SHARE is a test instance
N_TESTS = 5     # tests per instance (more when needed to catch the wrong solution)
MAX_MISSES = 100  # draws in a row without a new statement of the split before a family counts as used up


@dataclass(frozen=True)
class Task:
    family: str
    task_id: str
    entry_point: str
    text: str
    solution: str
    wrong: str
    tests: tuple[str, ...]

    @property
    def split(self) -> str:
        return split_of(self.text)

    def row(self) -> dict[str, Any]:
        """MBPP-shaped (what read_tasks / normalize_task read), with the reference solution."""
        return {"task_id": self.task_id, "text": self.text, "entry_point": self.entry_point,
                "test_list": list(self.tests), "canonical_solution": self.solution, "family": self.family}

    def env_task(self) -> dict[str, Any]:
        """The env's task dict {prompt, label, metadata} (what the env's dataset yields)."""
        return {"prompt": self.text, "label": list(self.tests),
                "metadata": {"task_id": self.task_id, "entry_point": self.entry_point, "family": self.family}}


@dataclass(frozen=True)
class Spec:
    """One instance before its tests: the statement, the reference and wrong solutions as
    source text, and the inputs: fixed edge cases plus a drawer of random argument tuples."""

    entry_point: str
    text: str
    solution: str
    wrong: str
    edge_inputs: tuple[tuple, ...]
    draw: Callable[[random.Random], tuple]


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_of(text: str) -> str:
    return "test" if _stable_int(text) % TEST_SHARE == 0 else "train"


def _src(template: str, **params) -> str:
    """A function's source from a template with $placeholders (Python code has no $)."""
    return Template(template.strip("\n") + "\n").substitute(**params)


# -- random inputs --------------------------------------------------------------------------------
WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel", "lemon", "quiet", "brave",
         "delta", "ember", "frost", "gamma", "honey", "ivory", "jolly", "karma", "lunar", "amber", "eagle")


def ints(r: random.Random, lo: int = -20, hi: int = 30, n: tuple[int, int] = (3, 9)) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(*n))]


def word(r: random.Random, letters: str = string.ascii_lowercase, n: tuple[int, int] = (3, 9)) -> str:
    return "".join(r.choice(letters) for _ in range(r.randint(*n)))


def sentence(r: random.Random, n: tuple[int, int] = (2, 6)) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(*n)))


def small_dict(r: random.Random, keys: str = "abcdefgh", lo: int = -5, hi: int = 20) -> dict[str, int]:
    return {k: r.randint(lo, hi) for k in r.sample(keys, r.randint(1, 5))}


FAMILIES: dict[str, Callable[[random.Random], Spec]] = {}
CATEGORY: dict[str, str] = {}


def family(category: str):
    def register(fn: Callable[[random.Random], Spec]) -> Callable[[random.Random], Spec]:
        name = fn.__name__.removeprefix("_")
        FAMILIES[name] = fn
        CATEGORY[name] = category
        return fn
    return register


def _fn(name: str, args: str, does: str, sol: str, wrong: str, edges: tuple[tuple, ...],
        draw: Callable[[random.Random], tuple], **params) -> Spec:
    """The shape of (almost) every family: a function `name(args)` whose statement is "Write a
    function `name(args)` that <does>", and whose reference and wrong solutions are that function
    with the body `sol` / `wrong` ($placeholders filled from `params`)."""
    space = "" if does.startswith(",") else " "  # "that, for a sorted list xs, ..."
    return Spec(name, f"Write a function `{name}({args})` that{space}{does}",
                _src(f"def $n({args}):\n    {sol}", n=name, **params),
                _src(f"def $n({args}):\n    {wrong}", n=name, **params), edges, draw)


# -- string ---------------------------------------------------------------------------------------
@family("string")
def _count_char(r):
    c, name = r.choice("abcdehlmnorst"), r.choice(("count_char", "char_count", "occurrences"))
    return _fn(name, "s", f"returns how many times the lowercase letter '{c}' occurs in the string s "
                          f"(case-sensitive: '{c.upper()}' does not count).",
               "return s.count('$c')", "return s.lower().count('$c')",
               (("",), (f"{c}{c.upper()}x{c}",)), lambda rr: (word(rr, c + c.upper() + "xyz"),), c=c)


@family("string")
def _replace_char(r):
    a, b = r.sample("abcdeilnorstu", 2)
    name = r.choice(("replace_char", "swap_letter", "substitute"))
    return _fn(name, "s", f"returns s with every '{a}' replaced by '{b}'.",
               "return s.replace('$a', '$b')", "return s.replace('$a', '$b', 1)",
               (("",), (f"{a}x{a}{a}",)), lambda rr: (word(rr, a + b + "xyz"),), a=a, b=b)


@family("string")
def _letter_set(r):
    letters = "".join(sorted(r.sample("aeioubcdlmnrst", r.randint(2, 5))))
    variant = r.choice(("count", "remove"))
    name = r.choice(("count_letters_in", "letter_hits", "tally")) if variant == "count" else \
        r.choice(("strip_letters", "drop_letters", "without_letters"))
    shown = ", ".join(letters)
    if variant == "count":
        text = f"returns how many characters of the string s are one of the letters {shown}, in either case"
        sol, wrong = f"return sum(ch.lower() in {letters!r} for ch in s)", f"return sum(ch in {letters!r} for ch in s)"
    else:
        text = f"returns s without the letters {shown} (in either case), other characters kept in order"
        sol = f"return ''.join(ch for ch in s if ch.lower() not in {letters!r})"
        wrong = f"return ''.join(ch for ch in s if ch not in {letters!r})"
    return _fn(name, "s", f"{text}.", sol, wrong, (("",), (letters.upper() + "xy" + letters,)),
               lambda rr: (word(rr, letters + letters.upper() + "xyz "),))


@family("string")
def _reverse_words(r):
    sep, name = r.choice(("-", ", ", " ", "|", "_", "/")), r.choice(("reverse_words", "words_backwards"))
    return _fn(name, "s", f"splits s on whitespace and returns its words in reverse order, joined by {sep!r}.",
               "return $sep.join(reversed(s.split()))", "return $sep.join(s.split())",
               (("",), ("one two  three",)), lambda rr: (sentence(rr),), sep=repr(sep))


@family("string")
def _repeat_chars(r):
    k, sep = r.randint(2, 4), r.choice(("", "-", " ", "."))
    name = r.choice(("stretch", "repeat_chars", "stutter"))
    return _fn(name, "s", f"repeats every character of s {k} times in place and joins these groups with "
                          f"{sep!r} ('ab' -> {sep.join(['a' * k, 'b' * k])!r}).",
               "return $sep.join(ch * $k for ch in s)", "return $sep.join(s * $k)",
               (("",), ("xy",)), lambda rr: (word(rr, n=(1, 6)),), k=k, sep=repr(sep))


@family("string")
def _words_starting(r):
    p, name = r.choice("abcdefghlmoprst"), r.choice(("words_starting", "filter_words", "pick_words"))
    return _fn(name, "s", f"returns the list of the words of s (split on whitespace) that start with the "
                          f"letter '{p}', in order.",
               "return [w for w in s.split() if w.startswith('$p')]", "return [w for w in s.split() if '$p' in w]",
               (("",), (f"{p}x y{p}z {p}",)),
               lambda rr: (" ".join(rr.choice((p, "x", "y" + p)) + word(rr, n=(1, 4)) for _ in range(rr.randint(2, 6))),),
               p=p)


@family("string")
def _caesar(r):
    k, name = r.randint(1, 25), r.choice(("shift_letters", "caesar", "rotate_letters"))
    return _fn(name, "s", f"shifts every lowercase letter of s by {k} places forward in the alphabet, wrapping "
                          f"around from 'z' to 'a'; other characters are unchanged.",
               "return ''.join(chr((ord(c) - 97 + $k) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)",
               "return ''.join(chr(ord(c) + $k) if 'a' <= c <= 'z' else c for c in s)",
               (("",), ("xyz, abc!",)), lambda rr: (word(rr, "abcmnxyz .!", n=(2, 10)),), k=k)


@family("string")
def _acronym(r):
    sep, k = r.choice(("", ".", "-", " ")), r.randint(1, 4)
    name = r.choice(("acronym", "initials", "abbreviate"))
    which = "each word" if k == 1 else f"each word of at least {k} letters"
    return _fn(name, "s", f"returns the first letter of {which} of s (split on whitespace), uppercased, "
                          f"joined by {sep!r}.",
               "return $sep.join(w[0].upper() for w in s.split()$cond)", "return $sep.join(w[0] for w in s.split()$cond)",
               (("",), ("portable network graphics",)),
               lambda rr: (" ".join(word(rr, n=(1, 6)) for _ in range(rr.randint(2, 6))),),
               sep=repr(sep), cond=f" if len(w) >= {k}" if k > 1 else "")


# -- list -----------------------------------------------------------------------------------------
@family("list")
def _filter_multiples(r):
    k, keep = r.randint(2, 9), r.random() < 0.5
    name = r.choice(("keep_multiples", "multiples_of")) if keep else r.choice(("drop_multiples", "without_multiples"))
    cond, other = ("x % $k == 0", "x % $k != 0") if keep else ("x % $k != 0", "x % $k == 0")
    what = "are" if keep else "are not"
    return _fn(name, "xs", f"returns, in order, the elements of the list of integers xs that {what} divisible by {k}.",
               f"return [x for x in xs if {cond}]", f"return [x for x in xs if {other}]",
               (([],), ([k, k + 1, 2 * k],)), lambda rr: (ints(rr),), k=k)


@family("list")
def _sum_above(r):
    t, strict = r.choice([v for v in range(-5, 21) if v]), r.random() < 0.5  # x == 0 adds nothing to a sum
    name = r.choice(("sum_above", "sum_over", "big_sum"))
    op, wrong_op, words = (">", ">=", "greater than") if strict else (">=", ">", "greater than or equal to")
    return _fn(name, "xs", f"returns the sum of the elements of xs that are {words} {t} (0 if there are none).",
               f"return sum(x for x in xs if x {op} $t)", f"return sum(x for x in xs if x {wrong_op} $t)",
               (([],), ([t, t + 1, t - 1],)), lambda rr: (ints(rr) + [t],), t=t)


@family("list")
def _scale_offset(r):
    a, b = r.choice((2, 3, -1, 4, 5, 10)), r.choice([v for v in range(-9, 10) if v])
    name = r.choice(("transform", "scale_shift", "affine"))
    return _fn(name, "xs", f"returns a new list with every element x of xs replaced by x * {a} + {b}.",
               "return [x * $a + $b for x in xs]", "return [(x + $b) * $a for x in xs]",
               (([],), ([0, 1],)), lambda rr: (ints(rr),), a=a, b=b)


@family("list")
def _chunk_sums(r):
    k, name = r.randint(2, 4), r.choice(("chunk_sums", "block_sums", "group_totals"))
    return _fn(name, "xs", f"splits xs into consecutive chunks of {k} elements (the last chunk may be shorter) "
                           f"and returns the list of the chunks' sums.",
               "return [sum(xs[i:i + $k]) for i in range(0, len(xs), $k)]",
               "return [sum(xs[i:i + $k]) for i in range(0, len(xs) - $k + 1, $k)]",
               (([],), (list(range(1, k + 2)),)), lambda rr: (ints(rr, n=(1, 11)),), k=k)


@family("list")
def _rotate(r):
    k, left = r.randint(3, 7), r.random() < 0.5  # k < 3: a plain slice is right for every list
    name = r.choice(("rotate", "rotate_list", "shift_list"))
    side = "left" if left else "right"
    body = "k = $k % len(xs)\n    return xs[k:] + xs[:k]" if left else "k = $k % len(xs)\n    return xs[-k:] + xs[:-k] if k else list(xs)"
    wrong = "return xs[$k:] + xs[:$k]" if left else "return xs[-$k:] + xs[:-$k]"
    return _fn(name, "xs", f"returns the list xs rotated by {k} positions to the {side} (for any length, "
                           f"including lists shorter than {k}; [] stays []).",
               f"if not xs:\n        return []\n    {body}", wrong,
               (([],), (list(range(1, k)),), (list(range(1, k + 3)),)), lambda rr: (ints(rr, n=(1, 8)),), k=k)


@family("list")
def _running(r):
    op, absolute = r.choice(("sum", "max", "min", "product")), r.random() < 0.5
    name = r.choice((f"running_{op}", f"cumulative_{op}", f"prefix_{op}"))
    step = {"sum": "acc = x if i == 0 else acc + x", "max": "acc = x if i == 0 else max(acc, x)",
            "min": "acc = x if i == 0 else min(acc, x)", "product": "acc = x if i == 0 else acc * x"}[op]
    of, get = ("the absolute values of ", "abs(x)") if absolute else ("", "x")
    take = "\n        x = abs(x)" if absolute else ""
    return _fn(name, "xs", f"returns a list whose i-th element is the {op} of {of}xs[0], ..., xs[i] (the running {op}).",
               f"out = []\n    for i, x in enumerate(xs):{take}\n        {step}\n        out.append(acc)\n    return out",
               f"out = []\n    for i, x in enumerate(xs):\n        out.append({get})\n    return out",
               (([],), ([3, -1, 4, 2],)), lambda rr: (ints(rr, -5, 9),))


@family("list")
def _count_in_range(r):
    lo = r.randint(-10, 10)
    hi = lo + r.randint(1, 15)
    name = r.choice(("count_between", "count_in_range", "how_many_between"))
    return _fn(name, "xs", f"returns how many elements x of xs satisfy {lo} <= x <= {hi}.",
               "return sum($lo <= x <= $hi for x in xs)", "return sum($lo <= x < $hi for x in xs)",
               (([],), ([lo, hi, hi + 1, lo - 1],)), lambda rr: (ints(rr, lo - 5, hi + 5),), lo=lo, hi=hi)


@family("list")
def _kth_largest(r):
    k, name = r.randint(2, 4), r.choice(("kth_largest", "nth_biggest", "rank_value"))
    return _fn(name, "xs", f"returns the {['', '', 'second', 'third', 'fourth'][k]} largest distinct value of xs "
                           f"(duplicates count once), or None if xs has fewer than {k} distinct values.",
               "s = sorted(set(xs), reverse=True)\n    return s[$i] if len(s) >= $k else None",
               "s = sorted(xs, reverse=True)\n    return s[$i] if len(s) >= $k else None",
               (([],), ([5, 5, 5, 4, 3, 3, 1],)), lambda rr: (ints(rr, 0, 8),), k=k, i=k - 1)


# -- dict -----------------------------------------------------------------------------------------
@family("dict")
def _letter_counts(r):
    k, name = r.randint(1, 3), r.choice(("letter_counts", "frequent_letters", "count_letters"))
    return _fn(name, "s", f"returns a dict mapping each letter occurring at least {k} times in s to its number "
                          f"of occurrences (other characters are ignored).",
               "out = {}\n    for c in s:\n        if c.isalpha():\n            out[c] = out.get(c, 0) + 1\n"
               "    return {c: v for c, v in out.items() if v >= $k}",
               "out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n"
               "    return {c: v for c, v in out.items() if v > $k}",
               (("",), ("a" * k + " b" + "c" * (k + 1),)), lambda rr: (word(rr, "aabbc 1", n=(2, 12)),), k=k)


@family("dict")
def _group_by_mod(r):
    k, name = r.randint(2, 5), r.choice(("group_by_remainder", "bucket_by_mod", "mod_groups"))
    return _fn(name, "xs", f"returns a dict mapping each remainder x % {k} that occurs among the integers xs to "
                           f"the list of those elements with that remainder, in input order.",
               "out = {}\n    for x in xs:\n        out.setdefault(x % $k, []).append(x)\n    return out",
               "out = {}\n    for x in sorted(xs):\n        out.setdefault(x % $k, []).append(x)\n    return out",
               (([],), ([2 * k + 1, 1],)), lambda rr: (ints(rr, 0, 30),), k=k)


@family("dict")
def _merge_counts(r):
    op, name = r.choice(("sum", "max", "min", "product")), r.choice(("merge_counts", "combine", "merge_dicts", "join_dicts"))
    expr = {"sum": "out[k] + v", "max": "max(out[k], v)", "min": "min(out[k], v)", "product": "out[k] * v"}[op]
    drop = r.choice((None, 0, 1))
    tail = "" if drop is None else f"; keys whose merged value is {drop} are left out"
    keep = "out" if drop is None else f"{{k: v for k, v in out.items() if v != {drop}}}"
    return _fn(name, "a, b", f"merges two dicts of integers: a key in only one of them keeps its value, a key in "
                             f"both gets the {op} of its two values{tail}.",
               f"out = dict(a)\n    for k, v in b.items():\n        out[k] = {expr} if k in out else v\n    return {keep}",
               "return {**a, **b}", (({}, {}), ({"x": 3}, {"x": 5, "y": 1}), ({"x": 7}, {"x": 2})),
               lambda rr: (small_dict(rr), small_dict(rr)))


@family("dict")
def _keys_above(r):
    t, name = r.randint(-3, 12), r.choice(("keys_above", "big_keys", "keys_over"))
    return _fn(name, "d", f"returns the sorted list of the keys of the dict d whose value is greater than {t}.",
               "return sorted(k for k, v in d.items() if v > $t)", "return [k for k, v in d.items() if v >= $t]",
               (({},), ({"b": t + 1, "a": t + 2, "c": t},)), lambda rr: (small_dict(rr, lo=t - 4, hi=t + 4),), t=t)


@family("dict")
def _invert(r):
    name = r.choice(("invert", "invert_dict", "keys_by_value", "reverse_map"))
    order, rev = r.choice((("sorted", ""), ("reverse-sorted", ", reverse=True")))
    return _fn(name, "d", f"inverts the dict d: it returns a dict mapping each value of d to the {order} list of "
                          f"the keys that have that value.",
               f"out = {{}}\n    for k, v in d.items():\n        out.setdefault(v, []).append(k)\n"
               f"    return {{v: sorted(ks{rev}) for v, ks in out.items()}}",
               "return {v: [k] for k, v in d.items()}",
               (({},), ({"b": 1, "a": 1, "c": 2},), ({"a": 1, "b": 1},)), lambda rr: (small_dict(rr, lo=0, hi=3),))


@family("dict")
def _word_lengths(r):
    k, name = r.randint(1, 5), r.choice(("word_lengths", "long_words", "length_map"))
    return _fn(name, "s", f"returns a dict mapping each word of s (split on whitespace) with at least {k} letters "
                          f"to its length.",
               "return {w: len(w) for w in s.split() if len(w) >= $k}", "return {w: len(w) for w in s.split() if len(w) > $k}",
               (("",), (f"{'a' * k} {'b' * (k + 1)}",)),
               lambda rr: (" ".join(word(rr, n=(max(1, k - 2), k + 2)) for _ in range(rr.randint(1, 5))),), k=k)


# -- arithmetic -----------------------------------------------------------------------------------
@family("arithmetic")
def _digit_power_sum(r):
    p, name = r.randint(2, 4), r.choice(("digit_power_sum", "digit_powers", "sum_digit_powers"))
    return _fn(name, "n", f"returns the sum of d ** {p} over the decimal digits d of the integer n (its sign is ignored).",
               "return sum(int(c) ** $p for c in str(abs(n)))", "return sum(int(c) for c in str(abs(n))) ** $p",
               ((0,), (-12,), (907,)), lambda rr: (rr.randint(-10**6, 10**6),), p=p)


@family("arithmetic")
def _series_sum(r):
    a, d = r.randint(-5, 10), r.randint(1, 7)
    name = r.choice(("series_sum", "sum_of_terms", "progression_sum"))
    return _fn(name, "n", f"returns the sum of the first n terms of the arithmetic sequence {a}, {a + d}, "
                          f"{a + 2 * d}, ... (0 for n == 0).",
               "return sum($a + i * $d for i in range(n))", "return sum($a + i * $d for i in range(n + 1))",
               ((0,), (1,), (3,)), lambda rr: (rr.randint(0, 40),), a=a, d=d)


@family("arithmetic")
def _count_divisible(r):
    a, b = r.sample(range(2, 10), 2)
    name = r.choice(("count_divisible", "count_multiples", "either_multiple"))
    return _fn(name, "n", f"returns how many integers in 1..n (inclusive) are divisible by {a} or by {b} (or both).",
               "return sum(1 for i in range(1, n + 1) if i % $a == 0 or i % $b == 0)", "return n // $a + n // $b",
               ((0,), (a * b,)), lambda rr: (rr.randint(1, 200),), a=a, b=b)


@family("arithmetic")
def _to_base(r):
    b, name = r.randint(2, 9), r.choice(("to_base", "in_base", "convert_base"))
    return _fn(name, "n", f"returns the base-{b} representation of the non-negative integer n as a string of "
                          f"digits ('0' for 0).",
               "if n == 0:\n        return '0'\n    out = ''\n    while n:\n        out = str(n % $b) + out\n"
               "        n //= $b\n    return out",
               "out = ''\n    while n:\n        out += str(n % $b)\n        n //= $b\n    return out",
               ((0,), (b + 1,), (b * b + 2,)), lambda rr: (rr.randint(0, 5000),), b=b)


@family("arithmetic")
def _divisors(r):
    op, parity, proper = r.choice(("count", "sum")), r.choice(("", "odd ", "even ")), r.random() < 0.5
    name = r.choice((f"{op}_{parity.strip() or 'all'}_divisors", f"divisor_{op}", f"{op}_divisors"))
    what = {"count": "the number", "sum": "the sum"}[op]
    cond = "n % d == 0" + {"": "", "odd ": " and d % 2 == 1", "even ": " and d % 2 == 0"}[parity]
    term = "1" if op == "count" else "d"
    which = "that are smaller than n" if proper else "(n itself included)"
    top, wrong_top = ("n", "n + 1") if proper else ("n + 1", "n")  # the typical mistake: the range off by one
    return _fn(name, "n", f"returns {what} of the {parity}positive divisors of the positive integer n {which}.",
               f"return sum({term} for d in range(1, {top}) if {cond})",
               f"return sum({term} for d in range(1, {wrong_top}) if {cond})",
               ((1,), (12,), (9,), (16,)), lambda rr: (rr.randint(1, 300),))


@family("arithmetic")
def _fizzbuzz(r):
    (a, b), (wa, wb) = r.sample(range(2, 8), 2), r.sample(("Fizz", "Buzz", "Zap", "Bop", "Ping", "Pong"), 2)
    name = r.choice(("fizzbuzz", "say_numbers", "game_words"))
    return _fn(name, "n", f"returns a list of strings for 1..n: '{wa}{wb}' for multiples of both {a} and {b}, "
                          f"'{wa}' for multiples of {a}, '{wb}' for multiples of {b}, otherwise the number itself "
                          f"as a string.",
               "out = []\n    for i in range(1, n + 1):\n        if i % $a == 0 and i % $b == 0:\n"
               "            out.append('$wa$wb')\n        elif i % $a == 0:\n            out.append('$wa')\n"
               "        elif i % $b == 0:\n            out.append('$wb')\n        else:\n"
               "            out.append(str(i))\n    return out",
               "out = []\n    for i in range(1, n + 1):\n        if i % $a == 0:\n            out.append('$wa')\n"
               "        elif i % $b == 0:\n            out.append('$wb')\n        else:\n"
               "            out.append(str(i))\n    return out",
               ((0,), (a * b,)), lambda rr: (rr.randint(1, 2 * a * b),), a=a, b=b, wa=wa, wb=wb)


# -- parsing --------------------------------------------------------------------------------------
@family("parsing")
def _parse_pairs(r):
    sep, kv = r.choice((";", ",", "&", "|")), r.choice(("=", ":"))
    name = r.choice(("parse_pairs", "parse_settings", "read_pairs"))
    ex = f"a{kv}1{sep}bc{kv}22"
    loop = "out = {}\n    for part in s.split($sep):\n        if part:\n            k, v = part.split($kv, 1)\n"
    return _fn(name, "s", f"parses a string like {ex!r} (pairs separated by {sep!r}, key and integer value "
                          f"separated by {kv!r}) into a dict of str to int; '' gives {{}}.",
               loop + "            out[k] = int(v)\n    return out", loop + "            out[k] = v\n    return out",
               (("",), (ex,)),
               lambda rr: (sep.join(f"{word(rr, n=(1, 4))}{kv}{rr.randint(-50, 500)}" for _ in range(rr.randint(1, 4))),),
               sep=repr(sep), kv=repr(kv))


@family("parsing")
def _numbers_in_text(r):
    op, name = r.choice((("sum", "sum_numbers"), ("max", "largest_number"), ("count", "count_numbers")))
    t = r.choice((0, 0, 5, 10, 20, 50, 100))
    expr = {"sum": "sum(nums)", "max": "max(nums) if nums else 0", "count": "len(nums)"}[op]
    what = {"sum": "the sum of", "max": "the largest of (0 if there is none)", "count": "how many there are of"}[op]
    which = "them" if t == 0 else f"those that are at least {t}"
    keep = "" if t == 0 else f" if int(m) >= {t}"
    return Spec(name, f"Write a function `{name}(s)` that finds the numbers written in s (maximal runs of "
                      f"digits, read as non-negative integers) and returns {what} {which}.",
                _src(f"import re\n\ndef $n(s):\n    nums = [int(m) for m in re.findall(r'\\d+', s){keep}]\n"
                     f"    return {expr}", n=name),
                _src(f"def $n(s):\n    nums = [int(c) for c in s if c.isdigit()]\n    return {expr}", n=name),
                (("",), ("a12b3 40",)),
                lambda rr: (" ".join(rr.choice((str(rr.randint(0, 999)), word(rr, n=(1, 4)))) for _ in range(rr.randint(1, 6))),))


@family("parsing")
def _clock(r):
    sep, seconds = r.choice((":", "h", ".")), r.random() < 0.5
    name = r.choice(("to_seconds", "clock_seconds")) if seconds else r.choice(("to_minutes", "clock_minutes"))
    if seconds:
        fmt, unit = f"H{sep}MM{sep}SS", "seconds"
        sol = "h, m, s = t.split($sep)\n    return int(h) * 3600 + int(m) * 60 + int(s)"
        wrong = "h, m, s = t.split($sep)\n    return int(h) * 60 + int(m) * 60 + int(s)"
        draw = lambda rr: (f"{rr.randint(0, 23)}{sep}{rr.randint(0, 59):02d}{sep}{rr.randint(0, 59):02d}",)  # noqa: E731
        edge = ((f"0{sep}00{sep}00",), (f"1{sep}02{sep}03",))
    else:
        fmt, unit = f"H{sep}MM", "minutes"
        sol = "h, m = t.split($sep)\n    return int(h) * 60 + int(m)"
        wrong = "h, m = t.split($sep)\n    return int(h) * 100 + int(m)"
        draw = lambda rr: (f"{rr.randint(0, 23)}{sep}{rr.randint(0, 59):02d}",)  # noqa: E731
        edge = ((f"0{sep}00",), (f"2{sep}05",))
    return _fn(name, "t", f"converts a time written as '{fmt}' (hours without leading zeros) into the total "
                          f"number of {unit} since 0{sep}00.", sol, wrong, edge, draw, sep=repr(sep))


@family("parsing")
def _plus_minus(r):
    m, name = r.choice((None, 7, 10, 100)), r.choice(("evaluate", "calc", "eval_sum"))
    tail = "" if m is None else f" modulo {m} (a value in 0..{m - 1})"
    ret = "total" if m is None else f"total % {m}"
    return Spec(name, f"Write a function `{name}(expr)` that evaluates a string like '12+5-3' made of "
                      f"non-negative integers joined by + and - (no spaces) and returns its value{tail}. "
                      f"Do not use eval.",
                _src(f"import re\n\ndef $n(expr):\n    total = 0\n    for sign, num in re.findall(r'([+-]?)(\\d+)', expr):\n"
                     f"        total += -int(num) if sign == '-' else int(num)\n    return {ret}", n=name),
                _src(f"import re\n\ndef $n(expr):\n    total = sum(int(num) for num in re.findall(r'\\d+', expr))\n"
                     f"    return {ret}", n=name),
                (("0",), ("12+5-3",)),
                lambda rr: ("".join(f"{rr.choice('+-') if i else ''}{rr.randint(0, 99)}" for i in range(rr.randint(1, 5))),))


@family("parsing")
def _csv_field(r):
    d, i = r.choice((",", ";", "|", "\t")), r.randint(0, 3)
    name = r.choice(("field", "get_field", "column"))
    return _fn(name, "line", f"splits line on {d!r} and returns field number {i} (counting from 0) with surrounding "
                             f"whitespace removed, or '' if the line has fewer fields.",
               "parts = line.split($d)\n    return parts[$i].strip() if len(parts) > $i else ''",
               "parts = line.split($d)\n    return parts[$i] if len(parts) > $i else ''",
               (("",), (d.join(f" w{j} " for j in range(i + 2)),)),
               lambda rr: (d.join(rr.choice(("", " ")) + word(rr, n=(1, 5)) + rr.choice(("", " "))
                                  for _ in range(rr.randint(1, 6))),), d=repr(d), i=i)


# -- simple algorithms ----------------------------------------------------------------------------
@family("algorithms")
def _search_sorted(r):
    strict = r.random() < 0.5
    name = r.choice(("first_above", "upper_index")) if strict else r.choice(("first_at_least", "lower_index"))
    op, wrong_op = (">", ">=") if strict else (">=", ">")
    words = "greater than" if strict else "greater than or equal to"
    none = r.choice(("len(xs)", "-1", "None"))
    return _fn(name, "xs, x", f", for a sorted list xs, returns the index of the first element {words} x, or "
                              f"{none} if there is none (binary search is welcome).",
               f"for i, v in enumerate(xs):\n        if v {op} x:\n            return i\n    return {none}",
               f"for i, v in enumerate(xs):\n        if v {wrong_op} x:\n            return i\n    return {none}",
               (([], 3), ([1, 3, 3, 5], 3)), lambda rr: (sorted(ints(rr, 0, 12)), rr.randint(0, 12)))


@family("algorithms")
def _longest_run(r):
    kind = r.choice(("equal", "increasing", "non-decreasing", "decreasing", "non-increasing"))
    name = r.choice(("longest_run", "longest_streak", f"longest_{kind.replace('-', '_')}_run"))
    cond = {"equal": "xs[i] == xs[i - 1]", "increasing": "xs[i] > xs[i - 1]", "non-decreasing": "xs[i] >= xs[i - 1]",
            "decreasing": "xs[i] < xs[i - 1]", "non-increasing": "xs[i] <= xs[i - 1]"}[kind]
    what = {"equal": "of equal consecutive elements", "increasing": "of consecutive elements, each greater than the one before",
            "non-decreasing": "of consecutive elements, each at least the one before",
            "decreasing": "of consecutive elements, each smaller than the one before",
            "non-increasing": "of consecutive elements, each at most the one before"}[kind]
    return _fn(name, "xs", f"returns the length of the longest run {what} in xs (0 for an empty list).",
               f"best = cur = 0\n    for i in range(len(xs)):\n        cur = cur + 1 if i and {cond} else 1\n"
               f"        best = max(best, cur)\n    return best",
               f"runs = 0\n    for i in range(len(xs)):\n        if not (i and {cond}):\n            runs += 1\n    return runs",
               (([],), ([1, 1, 2, 3, 3, 3, 0],)), lambda rr: (ints(rr, 0, 4, n=(1, 10)),))


@family("algorithms")
def _pairs_with_diff(r):
    k, name = r.randint(1, 5), r.choice(("pairs_with_difference", "count_pairs", "diff_pairs"))
    return _fn(name, "xs", f"returns the number of index pairs i < j with abs(xs[i] - xs[j]) == {k}.",
               "return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if abs(xs[i] - xs[j]) == $k)",
               "return sum(1 for i in range(len(xs)) for j in range(len(xs)) if xs[i] - xs[j] == $k) * 2",
               (([],), ([0, k, 2 * k, k],)), lambda rr: (ints(rr, 0, 10),), k=k)


@family("algorithms")
def _dedupe(r):
    last, name = r.random() < 0.5, r.choice(("dedupe", "unique", "remove_duplicates", "distinct", "uniq"))
    if last:
        text = "keeping only the last occurrence of each value, in the order those last occurrences appear"
        sol = "seen, out = set(), []\n    for x in reversed(xs):\n        if x not in seen:\n            seen.add(x)\n" \
              "            out.append(x)\n    return out[::-1]"
    else:
        text = "keeping only the first occurrence of each value, in order"
        sol = "seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n" \
              "            out.append(x)\n    return out"
    return _fn(name, "xs", f"returns xs without duplicates, {text}.", sol, "return sorted(set(xs))",
               (([],), ([3, 1, 3, 2, 1],)), lambda rr: (ints(rr, 0, 6),))


@family("algorithms")
def _balanced(r):
    pairs = "".join(r.sample(("()", "[]", "{}", "<>"), r.randint(1, 3)))
    name = r.choice(("balanced", "brackets_ok", "is_balanced"))
    shown = " ".join(pairs[i:i + 2] for i in range(0, len(pairs), 2))
    return _fn(name, "s", f"returns True if the brackets {shown} in s are balanced and properly nested, else "
                          f"False (all other characters are ignored).",
               "closing = {$close}\n    stack = []\n    for c in s:\n        if c in $opens:\n"
               "            stack.append(c)\n        elif c in closing:\n"
               "            if not stack or stack.pop() != closing[c]:\n                return False\n    return not stack",
               "return all(s.count(o) == s.count(c) for o, c in zip($opens, $closes))",
               (("",), (pairs[1] + pairs[0],), (pairs[0] + "x" + pairs[1],)),
               lambda rr: ("".join(rr.choice(pairs + "ab") for _ in range(rr.randint(1, 8))),),
               opens=repr(pairs[::2]), closes=repr(pairs[1::2]),
               close=", ".join(f"{pairs[i + 1]!r}: {pairs[i]!r}" for i in range(0, len(pairs), 2)))


@family("algorithms")
def _matrix(r):
    what, name = r.choice((("row sums", "row_sums"), ("column sums", "column_sums"), ("diagonal", "diagonal"),
                           ("transpose", "transpose"), ("row maxima", "row_max"), ("column minima", "column_min"),
                           ("flip", "mirror")))
    sol, wrong, text = {
        "row sums": ("return [sum(row) for row in m]", "return [sum(col) for col in zip(*m)]",
                     "the list of the sums of its rows"),
        "column sums": ("return [sum(col) for col in zip(*m)]", "return [sum(row) for row in m]",
                        "the list of the sums of its columns ([] for [])"),
        "diagonal": ("return [m[i][i] for i in range(min(len(m), len(m[0]) if m else 0))]",
                     "return [row[0] for row in m]", "the list m[0][0], m[1][1], ... as far as both dimensions go"),
        "transpose": ("return [list(col) for col in zip(*m)]", "return [list(row) for row in m]", "its transpose"),
        "row maxima": ("return [max(row) for row in m]", "return [max(col) for col in zip(*m)]",
                       "the list of the largest element of each row"),
        "column minima": ("return [min(col) for col in zip(*m)]", "return [min(row) for row in m]",
                          "the list of the smallest element of each column ([] for [])"),
        "flip": ("return [row[::-1] for row in m]", "return m[::-1]", "the matrix with each row reversed"),
    }[what]
    return _fn(name, "m", f", for a rectangular matrix m given as a list of rows (lists of integers), returns {text}.",
               sol, wrong, (([],), ([[1, 2, 3], [4, 5, 6]],)),
               lambda rr: ((lambda w: [ints(rr, -9, 9, n=(w, w)) for _ in range(rr.randint(1, 4))])(rr.randint(1, 4)),))


# -- instances ------------------------------------------------------------------------------------
def _function(source: str, entry: str) -> Callable:
    scope: dict[str, Any] = {}
    exec(compile(source, f"<{entry}>", "exec"), scope)  # this file's own reference/wrong code
    return scope[entry]


def _outcome(fn: Callable, args: tuple) -> tuple[bool, Any]:
    try:
        return True, fn(*[copy.deepcopy(a) for a in args])  # a solution may change its arguments
    except Exception as e:  # a wrong solution may raise
        return False, type(e).__name__


def _says_little(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and not value)


def _assert(entry: str, args: tuple, expected: Any) -> str:
    return f"assert {entry}({', '.join(repr(a) for a in args)}) == {expected!r}"


def build(family_name: str, instance: int) -> Task:
    """Instance `instance` of a family: its parameters from a RNG seeded by (family, instance);
    its tests from inputs drawn by a RNG seeded by its statement (the same statement, the same tests)."""
    if family_name not in FAMILIES:
        raise ValueError(f"code tasks: unknown family {family_name!r}; families: {', '.join(FAMILIES)}")
    spec = FAMILIES[family_name](random.Random(f"{family_name}/{instance}"))
    ref, wrong = _function(spec.solution, spec.entry_point), _function(spec.wrong, spec.entry_point)
    rr = random.Random(_stable_int(spec.text))
    inputs, seen = [], set()
    candidates = itertools.chain(spec.edge_inputs, (spec.draw(rr) for _ in range(200)))
    caught = False
    for args in candidates:
        key = repr(args)
        if key in seen:
            continue
        ok, expected = _outcome(ref, args)
        if not ok:
            raise AssertionError(f"code tasks: {family_name}/{instance}: the reference raised {expected} on {args!r}")
        bad = _outcome(wrong, args) != (True, expected)
        if len(inputs) >= N_TESTS and (caught or not bad):
            if caught:
                break
            continue  # look on for an input that catches the wrong solution
        seen.add(key)
        inputs.append((args, expected))
        caught = caught or bad
        if caught and len(inputs) >= N_TESTS:
            break
    if not caught:
        raise AssertionError(f"code tasks: {family_name}/{instance}: no input tells the wrong solution apart")
    # the env shows the first test as the example: a drawn input with a telling answer first (an
    # edge case such as '' -> 0, or an empty result, says little about the function)
    edges = {repr(a) for a in spec.edge_inputs}
    inputs.sort(key=lambda pair: (repr(pair[0]) in edges, _says_little(pair[1])))
    tests = tuple(_assert(spec.entry_point, args, expected) for args, expected in inputs)
    return Task(family_name, f"gen/{family_name}/{instance}", spec.entry_point, spec.text, spec.solution,
                spec.wrong, tests)


def task_from_id(task_id: str) -> Task | None:
    """The generated instance behind a task_id 'gen/FAMILY/N', or None for any other id."""
    parts = str(task_id).split("/")
    if len(parts) != 3 or parts[0] != "gen" or parts[1] not in FAMILIES or not parts[2].isdigit():
        return None
    return build(parts[1], int(parts[2]))


def generate_tasks(seed: int = 0, split: str = "train", n: int | None = None,
                   families: list[str] | None = None) -> Iterator[Task]:
    """Tasks of one split from a seeded RNG: the families in turn (shuffled each round), a random
    instance of each. With `n`: that many distinct statements (a family whose statements of this
    split ran out drops out); without: an endless stream, where a statement may come again."""
    if split not in SPLITS:
        raise ValueError(f"code tasks: split must be one of {SPLITS}, got {split!r}")
    names = list(families or FAMILIES)
    for name in names:
        if name not in FAMILIES:
            raise ValueError(f"code tasks: unknown family {name!r}; families: {', '.join(FAMILIES)}")
    return _stream(seed, split, n, names)  # checked above, at the call: not at the first task


def _stream(seed: int, split: str, n: int | None, active: list[str]) -> Iterator[Task]:
    families = list(active)
    rng = random.Random(f"agentrl-code-{seed}-{split}")
    seen: set[str] = set()
    misses = dict.fromkeys(active, 0)  # draws in a row that gave nothing new, per family
    count = 0
    while active:
        for name in rng.sample(active, len(active)):
            task = build(name, rng.randrange(10**9))
            if task.split != split or (n is not None and task.text in seen):
                misses[name] += 1
                if misses[name] >= MAX_MISSES:
                    active.remove(name)
                continue
            misses[name] = 0
            seen.add(task.text)
            yield task
            count += 1
            if n is not None and count >= n:
                return
    raise ValueError(f"code tasks: only {count} distinct {split} tasks in families {families}")


def generate(seed: int = 0, split: str = "train", n: int | None = None,
             families: list[str] | None = None) -> Iterator[dict]:
    """generate_tasks as the env's task dicts {prompt, label, metadata}."""
    return (t.env_task() for t in generate_tasks(seed, split, n, families))
