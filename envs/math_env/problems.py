"""A seeded generator of arithmetic word problems with integer answers.

Each task is ``{"prompt": problem, "label": "<integer>", "metadata": {"kind": ..., "id": ...}}``.
The problems are short multi-step word problems (GSM8K-like, smaller numbers), so a
small model can learn them and a tool (python) helps with the arithmetic.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

NAMES = ("Mira", "Tomas", "Ayla", "Jonah", "Priya", "Kenji", "Lena", "Omar", "Sofia", "Ravi", "Nora", "Felix")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "coins", "cards", "plums")
CONTAINERS = ("boxes", "bags", "crates", "jars", "baskets")


def _shopping(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    n, price, paid_extra = r.randint(3, 12), r.randint(2, 15), r.randint(1, 40)
    paid = n * price + paid_extra
    return (f"{name} buys {n} {item} at {price} dollars each and pays with {paid} dollars. "
            f"How much change, in dollars, does {name} get back?", paid - n * price)


def _groups(r: random.Random):
    name, item, box = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    k, per, given = r.randint(3, 12), r.randint(4, 15), r.randint(1, 20)
    return (f"{name} has {k} {box} with {per} {item} in each. {name} gives away {given} {item}. "
            f"How many {item} does {name} have left?", k * per - given)


def _sharing(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each, left = r.randint(2, 9), r.randint(3, 14), r.randint(0, 6)
    total = friends * each + left
    return (f"{name} shares {total} {item} equally among {friends} friends and keeps the {left} left over. "
            f"How many {item} does each friend get?", each)


def _speed(r: random.Random):
    name = r.choice(NAMES)
    speed, hours, extra = r.randint(20, 90), r.randint(2, 7), r.randint(5, 60)
    return (f"{name} drives at {speed} kilometers per hour for {hours} hours, then walks {extra} kilometers more. "
            f"How many kilometers does {name} travel in total?", speed * hours + extra)


def _ages(r: random.Random):
    a, b = r.sample(NAMES, 2)
    age, diff, years = r.randint(5, 40), r.randint(2, 30), r.randint(2, 15)
    return (f"{a} is {age} years old. {b} is {diff} years older than {a}. "
            f"How old will {b} be in {years} years?", age + diff + years)


def _rectangle(r: random.Random):
    w, h, cut = r.randint(3, 25), r.randint(3, 25), r.randint(1, 3)
    sq = min(w, h) // 2 or 1
    return (f"A garden is a rectangle {w} meters long and {h} meters wide. {cut} square flower beds, each "
            f"{sq} meters on a side, are dug out of it. How many square meters of lawn are left?", w * h - cut * sq * sq)


def _savings(r: random.Random):
    name = r.choice(NAMES)
    start, weekly, weeks, spent = r.randint(0, 50), r.randint(5, 30), r.randint(2, 12), r.randint(1, 40)
    return (f"{name} has {start} dollars saved and adds {weekly} dollars every week for {weeks} weeks, "
            f"then spends {spent} dollars on a gift. How many dollars does {name} have now?",
            start + weekly * weeks - spent)


def _percent(r: random.Random):
    item = r.choice(ITEMS)
    total, pct = r.choice((20, 40, 50, 60, 80, 100, 120, 200, 300, 400)), r.choice((10, 20, 25, 50, 75))
    return (f"A shop has {total} {item}. It sells {pct}% of them in the morning. "
            f"How many {item} are left?", total - total * pct // 100)


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "shopping": _shopping, "groups": _groups, "sharing": _sharing, "speed": _speed,
    "ages": _ages, "rectangle": _rectangle, "savings": _savings, "percent": _percent,
}


def make_problem(rng: random.Random) -> dict:
    kind = rng.choice(sorted(TEMPLATES))
    question, answer = TEMPLATES[kind](rng)
    return {"prompt": question, "label": str(answer), "metadata": {"kind": kind}}


def generate(seed: int = 0, n: int | None = None) -> Iterator[dict]:
    """Problems from a seeded RNG: `n` of them, or an endless stream when n is None."""
    rng = random.Random(f"agentrl-math-{seed}")
    i = 0
    while n is None or i < n:
        task = make_problem(rng)
        task["metadata"]["id"] = f"arith-{seed}-{i}"
        yield task
        i += 1
