"""Writes the built-in code tasks (data/tasks.jsonl): 20 small Python problems, MBPP-shaped
(``task_id``, ``text``, ``entry_point``, ``test_list``, ``canonical_solution``), each with
hidden assert tests. Deterministic; rerun after editing TASKS:

    python -m agentrl.envs.code_env.make_tasks

It also writes a split of the task generator (generator.py) as a task file of the same shape,
for `--env-kwargs '{"tasks": FILE}'`, or as env rows ({prompt, label, metadata}) for
`--eval-prompt-data NAME FILE`:

    python -m agentrl.envs.code_env.make_tasks --split test --n 200 --seed 1 --out heldout.jsonl [--env-rows]
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("data") / "tasks.jsonl"

# (entry point, statement, reference solution, tests)
TASKS = [
    ("running_max", "Write a function `running_max(xs)` that returns a list whose i-th element is the largest of xs[0..i].",
     "def running_max(xs):\n    out, best = [], None\n    for x in xs:\n        best = x if best is None or x > best else best\n        out.append(best)\n    return out\n",
     ["assert running_max([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]", "assert running_max([]) == []",
      "assert running_max([-2, -5, -1]) == [-2, -2, -1]", "assert running_max([7]) == [7]"]),
    ("is_palindrome", "Write a function `is_palindrome(s)` that says whether s reads the same backwards, ignoring case and every character that is not a letter or digit.",
     "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
     ["assert is_palindrome('A man, a plan, a canal: Panama') is True", "assert is_palindrome('abc') is False",
      "assert is_palindrome('') is True", "assert is_palindrome('No lemon, no melon') is True"]),
    ("word_counts", "Write a function `word_counts(text)` returning a dict mapping each lowercase word (split on whitespace, surrounding punctuation .,!? stripped) to its count.",
     "def word_counts(text):\n    out = {}\n    for w in text.split():\n        w = w.strip('.,!?').lower()\n        if w:\n            out[w] = out.get(w, 0) + 1\n    return out\n",
     ["assert word_counts('The cat and the hat.') == {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}",
      "assert word_counts('') == {}", "assert word_counts('Hi! hi? HI.') == {'hi': 3}"]),
    ("flatten", "Write a function `flatten(nested)` that flattens arbitrarily nested lists into one flat list, keeping order.",
     "def flatten(nested):\n    out = []\n    for x in nested:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
     ["assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]", "assert flatten([]) == []",
      "assert flatten([[[]], [1], [[2]]]) == [1, 2]", "assert flatten(['a', ['b']]) == ['a', 'b']"]),
    ("gcd", "Write a function `gcd(a, b)` returning the greatest common divisor of two non-negative integers (gcd(0, 0) == 0), without using math.gcd.",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
     ["assert gcd(12, 18) == 6", "assert gcd(17, 5) == 1", "assert gcd(0, 9) == 9", "assert gcd(0, 0) == 0"]),
    ("rle_encode", "Write a function `rle_encode(s)` that run-length encodes a string: 'aaabcc' -> 'a3b1c2'.",
     "def rle_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
     ["assert rle_encode('aaabcc') == 'a3b1c2'", "assert rle_encode('') == ''", "assert rle_encode('z') == 'z1'",
      "assert rle_encode('aabbaa') == 'a2b2a2'"]),
    ("primes_below", "Write a function `primes_below(n)` returning the sorted list of primes smaller than n.",
     "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n",
     ["assert primes_below(10) == [2, 3, 5, 7]", "assert primes_below(2) == []", "assert primes_below(0) == []",
      "assert primes_below(30)[-1] == 29 and len(primes_below(30)) == 10"]),
    ("two_sum", "Write a function `two_sum(nums, target)` returning the indices (i, j), i < j, of the first pair (smallest j, then smallest i) with nums[i] + nums[j] == target, or None.",
     "def two_sum(nums, target):\n    for j in range(len(nums)):\n        for i in range(j):\n            if nums[i] + nums[j] == target:\n                return (i, j)\n    return None\n",
     ["assert two_sum([2, 7, 11, 15], 9) == (0, 1)", "assert two_sum([3, 2, 4], 6) == (1, 2)",
      "assert two_sum([1, 2], 7) is None", "assert two_sum([5, 5, 5], 10) == (0, 1)"]),
    ("roman", "Write a function `roman(n)` converting an integer 1 <= n <= 3999 to a Roman numeral string.",
     "def roman(n):\n    vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for v, s in vals:\n        while n >= v:\n            out += s\n            n -= v\n    return out\n",
     ["assert roman(1994) == 'MCMXCIV'", "assert roman(4) == 'IV'", "assert roman(3999) == 'MMMCMXCIX'", "assert roman(58) == 'LVIII'"]),
    ("chunk", "Write a function `chunk(xs, size)` splitting a list into consecutive chunks of length size (the last may be shorter).",
     "def chunk(xs, size):\n    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
     ["assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "assert chunk([], 3) == []",
      "assert chunk([1, 2, 3], 3) == [[1, 2, 3]]"]),
    ("balanced", "Write a function `balanced(s)` that says whether the brackets ()[]{} in s are balanced (other characters are ignored).",
     "def balanced(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in s:\n        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack\n",
     ["assert balanced('([]{})') is True", "assert balanced('([)]') is False", "assert balanced('') is True",
      "assert balanced('a(b)c]') is False", "assert balanced('((') is False"]),
    ("digit_sum", "Write a function `digit_sum(n)` returning the sum of the decimal digits of the integer n (the sign is ignored).",
     "def digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))\n",
     ["assert digit_sum(1234) == 10", "assert digit_sum(0) == 0", "assert digit_sum(-905) == 14"]),
    ("merge_sorted", "Write a function `merge_sorted(a, b)` merging two sorted lists into one sorted list (do not just call sorted on the concatenation; the result must be the same though).",
     "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
     ["assert merge_sorted([1, 4, 6], [2, 3, 7]) == [1, 2, 3, 4, 6, 7]", "assert merge_sorted([], [1]) == [1]",
      "assert merge_sorted([1, 1], [1]) == [1, 1, 1]"]),
    ("caesar", "Write a function `caesar(text, shift)` that shifts every ASCII letter by shift places in the alphabet (wrapping, keeping case); other characters are unchanged.",
     "def caesar(text, shift):\n    out = []\n    for c in text:\n        if 'a' <= c <= 'z':\n            out.append(chr((ord(c) - 97 + shift) % 26 + 97))\n        elif 'A' <= c <= 'Z':\n            out.append(chr((ord(c) - 65 + shift) % 26 + 65))\n        else:\n            out.append(c)\n    return ''.join(out)\n",
     ["assert caesar('abc', 1) == 'bcd'", "assert caesar('Hello, World!', 3) == 'Khoor, Zruog!'",
      "assert caesar('xyz', 3) == 'abc'", "assert caesar('abc', -1) == 'zab'"]),
    ("second_largest", "Write a function `second_largest(xs)` returning the second largest distinct value of xs, or None if there is none.",
     "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None\n",
     ["assert second_largest([3, 1, 4, 4, 2]) == 3", "assert second_largest([5, 5]) is None",
      "assert second_largest([]) is None", "assert second_largest([-1, -3]) == -3"]),
    ("transpose", "Write a function `transpose(m)` returning the transpose of a rectangular matrix given as a list of rows.",
     "def transpose(m):\n    return [list(r) for r in zip(*m)]\n",
     ["assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]", "assert transpose([]) == []",
      "assert transpose([[1]]) == [[1]]"]),
    ("anagrams", "Write a function `anagrams(words)` grouping words that are anagrams of each other: return a list of groups, each group in input order, groups ordered by their first word's position.",
     "def anagrams(words):\n    groups = {}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), []).append(w)\n    return list(groups.values())\n",
     ["assert anagrams(['eat', 'tea', 'tan', 'ate', 'nat', 'bat']) == [['eat', 'tea', 'ate'], ['tan', 'nat'], ['bat']]",
      "assert anagrams([]) == []", "assert anagrams(['a']) == [['a']]"]),
    ("binary_search", "Write a function `binary_search(xs, x)` returning the index of x in the sorted list xs, or -1 if absent.",
     "def binary_search(xs, x):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if xs[mid] == x:\n            return mid\n        if xs[mid] < x:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n",
     ["assert binary_search([1, 3, 5, 7, 9], 7) == 3", "assert binary_search([1, 3, 5], 4) == -1",
      "assert binary_search([], 1) == -1", "assert binary_search([2], 2) == 0"]),
    ("fizzbuzz", "Write a function `fizzbuzz(n)` returning the list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else the number.",
     "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n",
     ["assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']", "assert fizzbuzz(15)[-1] == 'FizzBuzz'",
      "assert fizzbuzz(0) == []"]),
    ("snake_case", "Write a function `snake_case(name)` converting a CamelCase or camelCase identifier to snake_case ('HTTPServer' -> 'http_server', 'parseJSONData' -> 'parse_json_data').",
     "import re\n\ndef snake_case(name):\n    s = re.sub(r'([A-Z]+)([A-Z][a-z])', r'\\1_\\2', name)\n    s = re.sub(r'([a-z0-9])([A-Z])', r'\\1_\\2', s)\n    return s.lower()\n",
     ["assert snake_case('CamelCase') == 'camel_case'", "assert snake_case('HTTPServer') == 'http_server'",
      "assert snake_case('parseJSONData') == 'parse_json_data'", "assert snake_case('x') == 'x'"]),
]


def rows() -> list[dict]:
    return [{"task_id": f"agentrl-code-{i}", "text": text, "entry_point": name, "test_list": tests,
             "canonical_solution": solution} for i, (name, text, solution, tests) in enumerate(TASKS)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("train", "test"), help="write the generator's split (else the 20 built-in tasks)")
    parser.add_argument("--n", type=int, default=200, help="distinct tasks of the split (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--env-rows", action="store_true", help="{prompt, label, metadata} rows, not MBPP-shaped")
    args = parser.parse_args(argv)
    if args.split is None:
        out, lines = args.out or OUT, rows()
    else:
        from agentrl.envs.code_env.generator import generate_tasks

        if args.out is None:
            parser.error("--split needs --out")
        tasks = generate_tasks(seed=args.seed, split=args.split, n=args.n)
        out, lines = args.out, [t.env_task() if args.env_rows else t.row() for t in tasks]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    print(f"{out}: {len(lines)} tasks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
